import math
from pathlib import Path

import numpy as np
import pytest
import torch

from k3infra.train.corpus import Corpus
from k3infra.train.packing import IGNORE_INDEX, PackedDataset, pack_rows
from k3infra.train.tokenizer import EOS_TOKEN, encode_corpus, load_or_train_tokenizer, unigram_entropy

MiB = 1 << 20


def test_stdlib_corpus_is_deterministic():
    a = Corpus.from_paths(None, max_bytes=MiB // 4)
    b = Corpus.from_paths(None, max_bytes=MiB // 4)
    assert a.fingerprint == b.fingerprint and a.sources == b.sources
    assert list(a.sources) == sorted(a.sources) and a.num_bytes >= MiB // 4


def test_local_jsonl_and_text(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n\n{"text": "second doc"}\n')
    (tmp_path / "b.txt").write_text("plain text file")
    corpus = Corpus.from_paths([tmp_path])
    assert corpus.documents == ("hello world", "second doc", "plain text file")


def test_folder_walk_is_in_sorted_path_order(tmp_path):
    """Files in sorted-path order ("b/..." before "b-c/..." before "b.txt"), skipped folders never read, a symlinked
    folder (here a loop) not entered."""
    names = ["b.txt", "b/c.md", "b-c/d.jsonl", "B/z.py", "a b/e.py", "b/test/u.py", "b/__pycache__/x.py",
             "site-packages/s.py", "x.bin"]
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'{{"text": "{name}"}}\n' if name.endswith(".jsonl") else name)
    (tmp_path / "b" / "loop").symlink_to(tmp_path, target_is_directory=True)
    corpus = Corpus.from_paths([tmp_path])
    expected = ["B/z.py", "a b/e.py", "b/c.md", "b/test/u.py", "b-c/d.jsonl", "b.txt"]
    assert [str(Path(f).relative_to(tmp_path)) for f in corpus.sources] == expected
    assert corpus.documents == tuple(expected)


@pytest.mark.parametrize("bad, match", [
    ("missing", "does not exist"),
    ("badjsonl", "string 'text'"),
    ("empty", "no documents"),
], ids=["missing-path", "jsonl-without-text", "empty-folder"])
def test_corpus_errors(tmp_path, bad, match):
    if bad == "badjsonl":
        (tmp_path / "x.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match=match):
        Corpus.from_paths([tmp_path / "nope"] if bad == "missing" else [tmp_path])


def test_tokenizer_roundtrip_and_cache(train_cache):
    corpus = Corpus.from_paths(None, max_bytes=MiB)
    tok = load_or_train_tokenizer(corpus, 512, train_cache)
    assert tok.get_vocab_size() == 512
    assert list(train_cache.glob("tokenizer-*-v512.json"))
    text = "def f(x):\n    return x + 1  # ü\n"
    assert tok.decode(tok.encode(text).ids) == text
    again = load_or_train_tokenizer(corpus, 512, train_cache)
    assert again.to_str() == tok.to_str()
    tokens = encode_corpus(corpus, tok, train_cache)
    eos = tok.token_to_id(EOS_TOKEN)
    assert tokens.dtype == np.int32 and int((tokens == eos).sum()) == len(corpus.documents) and tokens[-1] == eos
    assert 0 < unigram_entropy(tokens, 512) < math.log(512)


def test_tokenizer_rejects_small_vocab(train_cache):
    corpus = Corpus.from_paths(None, max_bytes=MiB // 8)
    with pytest.raises(ValueError, match="vocab_size"):
        load_or_train_tokenizer(corpus, 100, train_cache)


def test_unigram_entropy_of_known_distribution():
    tokens = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    assert unigram_entropy(tokens, 8) == pytest.approx(math.log(4))


def test_pack_rows_boundaries():
    tokens = np.arange(12).reshape(2, 6)
    starts = np.zeros((2, 6), dtype=bool)
    starts[0, 4] = True  # a document begins at position 4 of row 0
    starts[1, 1] = True
    batch = pack_rows(tokens, starts)
    assert batch.input_ids.shape == (1, 12) and batch.input_ids.dtype == torch.int64
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 7, 12] and batch.cu_seqlens.dtype == torch.int32
    ignored = (batch.labels[0] == IGNORE_INDEX).nonzero().flatten().tolist()
    assert ignored == [0, 4, 6, 7]
    kept = batch.labels[0] != IGNORE_INDEX
    assert torch.equal(batch.labels[0][kept], batch.input_ids[0][kept])
    assert batch.num_targets == 8


def _dataset(seq_len=8):
    # documents of lengths 3, 5, 11, 2 ... separated by eos=0
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=n) for n in (3, 5, 11, 2, 7, 9, 4, 13, 6, 1, 10, 8)]
    stream = np.concatenate([np.append(d, 0) for d in docs])
    return PackedDataset(stream, eos_id=0, seq_len=seq_len, seed=3), stream


def test_dataset_segments_follow_eos():
    dataset, stream = _dataset()
    for row in range(len(dataset)):
        batch = pack_rows(dataset.rows[row : row + 1], dataset.starts[row : row + 1])
        ids = batch.input_ids[0].numpy()
        cu = batch.cu_seqlens.numpy()
        for begin in cu[1:-1]:
            assert ids[begin - 1] == 0  # every inner boundary follows an end-of-text token
        assert np.array_equal(ids, stream[row * 8 : (row + 1) * 8])


def test_dataset_rank_split_and_determinism():
    dataset, _ = _dataset()
    whole = dataset.batch(step=2, batch_size=4)
    parts = [dataset.batch(step=2, batch_size=4, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([p.input_ids for p in parts], 1), whole.input_ids)
    assert sum(p.num_targets for p in parts) == whole.num_targets == dataset.num_targets(2, 4)
    assert torch.equal(dataset.batch(step=2, batch_size=4).input_ids, whole.input_ids)
    # epochs wrap around with a fresh order and every row appears once per epoch
    seen = np.concatenate([dataset.row_indices(s, 1) for s in range(len(dataset))])
    assert sorted(seen.tolist()) == list(range(len(dataset)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=3, world_size=2), "multiple of the world size"),
    (dict(batch_size=2, world_size=2, rank=2), "rank"),
], ids=["batch-not-divisible", "rank-out-of-range"])
def test_dataset_errors(kwargs, match):
    dataset, _ = _dataset()
    with pytest.raises(ValueError, match=match):
        dataset.batch(step=0, **kwargs)
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataset(np.arange(10), 0, seq_len=1)
