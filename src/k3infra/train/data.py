"""The training data in one call: corpus → cached BPE tokenizer → token stream → packed rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from k3infra.train.corpus import Corpus
from k3infra.train.packing import PackedDataset
from k3infra.train.tokenizer import EOS_TOKEN, encode_corpus, load_or_train_tokenizer, unigram_entropy


@dataclass(frozen=True)
class TrainData:
    """Everything the trainer reads.

    Attributes:
        tokenizer: the BPE tokenizer (``vocab_size`` tokens, ``<|endoftext|>`` between documents).
        dataset: packed rows of ``seq_len`` tokens.
        num_tokens: tokens in the stream.
        unigram_entropy: nats/token of the token frequencies, the bar the loss must go well below.
        uniform_entropy: ``ln(vocab_size)``, the loss of a uniform prediction.
        corpus_fingerprint: SHA-256 of the documents.
    """

    tokenizer: Tokenizer
    dataset: PackedDataset
    num_tokens: int
    unigram_entropy: float
    uniform_entropy: float
    corpus_fingerprint: str


def prepare_data(
    paths: Sequence[str | Path] | None,
    *,
    vocab_size: int,
    seq_len: int,
    seed: int = 0,
    max_bytes: int | None = None,
    cache_dir: str | Path | None = None,
) -> TrainData:
    """Read the corpus, load or train the tokenizer, encode (cached) and pack.

    Args:
        paths: corpus files/folders (``None``: the Python standard library source).
        vocab_size: the model's vocabulary size.
        seq_len: tokens per packed row.
        seed: seed of the row order.
        max_bytes: read at most about this many bytes of text.
        cache_dir: tokenizer and token cache folder.
    """
    corpus = Corpus.from_paths(paths, max_bytes=max_bytes)
    tokenizer = load_or_train_tokenizer(corpus, vocab_size, cache_dir)
    tokens = encode_corpus(corpus, tokenizer, cache_dir)
    dataset = PackedDataset(tokens, tokenizer.token_to_id(EOS_TOKEN), seq_len, seed=seed)
    return TrainData(
        tokenizer=tokenizer,
        dataset=dataset,
        num_tokens=int(len(tokens)),
        unigram_entropy=unigram_entropy(tokens, vocab_size),
        uniform_entropy=math.log(vocab_size),
        corpus_fingerprint=corpus.fingerprint,
    )
