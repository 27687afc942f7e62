"""The device-side varlen chunk index (no host sync): every chunk of every sequence exactly once."""

import pytest
import torch

from flashkda.index import build_chunk_index


@pytest.mark.parametrize("lengths", [(64,), (1, 0, 130, 64, 0), (0,), (63, 65), (5,) * 20],
                         ids=["one", "mixed-empty", "all-empty", "around-64", "many-short"])
def test_chunk_map_lists_every_chunk_once(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    idx = build_chunk_index(1, int(cu[-1]), cu, 64)
    expected = [(n, j) for n, L in enumerate(lengths) for j in range(-(-L // 64))]
    got = [(int(n), i - int(idx.chunk_offsets[n])) for i, n in enumerate(idx.chunk_map.tolist()) if n >= 0]
    assert got == expected
    assert idx.num_chunks >= len(expected)
    assert all(n == -1 for n in idx.chunk_map.tolist()[len(expected):])


def test_fixed_length_index_needs_no_tensors():
    idx = build_chunk_index(3, 130, None, 64)
    assert (idx.num_seqs, idx.num_chunks, idx.chunks_per_seq, idx.is_varlen) == (3, 9, 3, False)


def test_varlen_index_is_kept_per_cu_seqlens_object():
    from flashkda.index import cached_chunk_index

    cu = torch.tensor([0, 70, 70, 130])
    first = cached_chunk_index(1, 130, cu, 64)
    assert cached_chunk_index(1, 130, cu, 64) is first
    assert cached_chunk_index(1, 130, cu.clone(), 64) is not first, "another tensor object"
    assert cached_chunk_index(1, 130, cu, 32) is not first, "another chunk size"
    cu[1] = 64  # in place: the kept index no longer applies
    again = cached_chunk_index(1, 130, cu, 64)
    assert again is not first
    assert again.chunk_offsets.tolist() == build_chunk_index(1, 130, cu, 64).chunk_offsets.tolist() == [0, 1, 2, 3]
    with torch.inference_mode():
        live = torch.tensor([0, 70, 70, 130])
        assert cached_chunk_index(1, 130, live, 64) is not cached_chunk_index(1, 130, live, 64), "no CPU copy"
        host = torch.tensor([0, 70, 70, 130])
        kept = cached_chunk_index(1, 130, live, 64, host)
        assert cached_chunk_index(1, 130, live, 64, host.clone()) is kept
