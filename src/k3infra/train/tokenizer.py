"""A byte-level BPE tokenizer trained on the corpus with `tokenizers`, cached on disk, and the encoded corpus.

The cache key is the corpus fingerprint and the vocabulary size, so a changed corpus or vocabulary retrains.
The encoded token stream is cached beside it (``tokens-<key>.npy``).

Example::

    >>> from k3infra.train.corpus import Corpus
    >>> from k3infra.train.tokenizer import load_or_train_tokenizer
    >>> corpus = Corpus.from_paths(None, max_bytes=1 << 20)
    >>> tok = load_or_train_tokenizer(corpus, vocab_size=512, cache_dir="/tmp/k3-cache")
    >>> tok.get_vocab_size()
    512
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3infra.train.corpus import Corpus

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
"""Appended to every document; the only special token."""

MIN_VOCAB = 257
"""256 byte tokens plus the end-of-text token."""


def default_cache_dir() -> Path:
    """``$K3INFRA_CACHE`` or ``~/.cache/k3infra``."""
    return Path(os.environ.get("K3INFRA_CACHE") or Path.home() / ".cache" / "k3infra")


def cache_key(corpus: Corpus, vocab_size: int) -> str:
    """``<first 16 hex digits of the corpus fingerprint>-v<vocab_size>``."""
    return f"{corpus.fingerprint[:16]}-v{vocab_size}"


def load_or_train_tokenizer(corpus: Corpus, vocab_size: int, cache_dir: str | Path | None = None) -> Tokenizer:
    """Load the cached tokenizer for (corpus, vocab_size) or train one and cache it.

    Args:
        corpus: the documents to learn merges from.
        vocab_size: exact size of the vocabulary (bytes + merges + ``<|endoftext|>``); the model's
            ``config.vocab_size``.
        cache_dir: where ``tokenizer-<key>.json`` lives (default `default_cache_dir`).

    Raises:
        ValueError: ``vocab_size`` < 257, or the corpus is too small to learn that many merges.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB} (256 bytes + end-of-text), got {vocab_size!r}")
    path = Path(cache_dir or default_cache_dir()) / f"tokenizer-{cache_key(corpus, vocab_size)}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.documents, trainer=trainer, length=len(corpus.documents))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is larger than the corpus supports ({tokenizer.get_vocab_size()} tokens "
            "learned); use a larger corpus or a smaller vocabulary"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    logger.info("trained a %d-token BPE tokenizer, cached at %s", vocab_size, path)
    return tokenizer


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | Path | None = None) -> np.ndarray:
    """Token ids of every document followed by ``<|endoftext|>``, concatenated (cached on disk).

    Returns:
        ``int32 [N]``: the token stream; a document starts at 0 and after every end-of-text token.
    """
    vocab = tokenizer.get_vocab_size()
    path = Path(cache_dir or default_cache_dir()) / f"tokens-{cache_key(corpus, vocab)}.npy"
    if path.is_file():
        return np.load(path)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    pieces = []
    for encoding in tokenizer.encode_batch(list(corpus.documents), add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids + [eos], dtype=np.int32))
    tokens = np.concatenate(pieces)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
    np.save(tmp, tokens)
    os.replace(tmp, path)
    return tokens


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequency distribution, in nats per token.

    This is the cross-entropy a model reaches by predicting token frequencies and nothing else; a language model
    that uses context must go well below it.

    Args:
        tokens: ``int [N]`` token ids in ``[0, vocab_size)``.
        vocab_size: size of the vocabulary.
    """
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum()) if p.size else math.nan
