"""Host copies of ``cu_seqlens`` and the varlen chunked layout are kept per tensor object, and only while it is
unmodified (the GPU test of a training step without host sync is in test_gpu.py)."""

import pytest
import torch

from flashkda.bwd.layout import make_layout
from flashkda.seqlens import IdentityCache, host_cu_seqlens


class _DeviceTensor(torch.Tensor):
    """A CPU tensor that claims to live on a GPU and counts its host copies, so the CPU suite can see how often a
    device ``cu_seqlens`` would be read."""

    copies = 0

    @property
    def device(self):
        return torch.device("cuda")

    def to(self, *args, **kwargs):
        if args and args[0] == "cpu":
            type(self).copies += 1
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)


def test_identity_cache_keys_on_the_object_and_its_modifications():
    cache = IdentityCache(size=2)
    a, b = torch.tensor([0, 3]), torch.tensor([0, 3])
    cache.put(a, "a")
    assert cache.get(a) == "a"
    assert cache.get(b) is None, "equal contents are a different tensor"
    a.add_(1)
    assert cache.get(a) is None, "an in-place change must invalidate the entry"
    cache.put(a, "a1")
    cache.put(b, "b")
    cache.put(torch.tensor([1]), "c")
    assert cache.get(a) is None and cache.get(b) == "b", "the oldest entry goes first"


def test_host_copy_is_made_once_per_tensor():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32).as_subclass(_DeviceTensor)
    _DeviceTensor.copies = 0
    first = host_cu_seqlens(cu)
    assert first.tolist() == [0, 5, 9] and first.dtype == torch.int64 and first.device.type == "cpu"
    assert host_cu_seqlens(cu) is first and _DeviceTensor.copies == 1
    cu.add_(0)  # an in-place write, even one that changes nothing, means a new read
    assert host_cu_seqlens(cu).tolist() == [0, 5, 9] and _DeviceTensor.copies == 2


def test_cu_seqlens_cpu_is_used_as_given():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    host = torch.tensor([0, 4, 8])
    assert host_cu_seqlens(cu, host) is host


@pytest.mark.parametrize("given_host_copy", [False, True])
def test_varlen_layout_is_kept_for_the_same_cu_seqlens(given_host_copy):
    cu = torch.tensor([0, 70, 70, 130], dtype=torch.int32)
    host = cu.to(torch.int64) if given_host_copy else None
    first = make_layout(1, 130, cu, 64, torch.device("cpu"), host)
    again = make_layout(1, 130, cu, 64, torch.device("cpu"), host)
    assert again is first
    assert first.num_chunks == 2 + 0 + 1
    assert first.chunk_offsets.tolist() == [0, 2, 2, 3]
    assert first.scatter_index.tolist() == list(range(70)) + list(range(128, 188))
    other = make_layout(1, 130, cu.clone(), 64, torch.device("cpu"))
    assert other is not first and other.num_chunks == first.num_chunks
    cu[1:] = torch.tensor([64, 64, 130], dtype=torch.int32)  # in place: the kept layout no longer applies
    changed = make_layout(1, 130, cu, 64, torch.device("cpu"))
    assert changed is not first
    assert changed.chunk_offsets.tolist() == [0, 1, 1, 3]
    assert changed.scatter_index.tolist() == list(range(130))


def test_inference_tensors_are_kept_only_with_their_cpu_copy():
    cache = IdentityCache(size=4)
    with torch.inference_mode():
        a = torch.tensor([0, 3, 7])
    witness = torch.tensor([0, 3, 7])
    assert a.is_inference()
    cache.put(a, "no witness")
    assert cache.get(a) is None, "no modification counter and no CPU copy: never kept"
    cache.put(a, "a", witness=witness)
    assert cache.get(a, witness=witness.clone()) == "a", "the copy's values are the key, not the copy object"
    assert cache.get(a, witness=torch.tensor([0, 4, 7])) is None
    assert cache.get(a, witness=witness.int()) is None, "another dtype is another key"
    assert cache.get(a) is None


def test_inference_host_copy_is_made_once_per_tensor_and_cpu_values():
    from flashkda.checks import KDAShapes, check_cu_seqlens

    with torch.inference_mode():
        cu = torch.tensor([0, 5, 9], dtype=torch.int32).as_subclass(_DeviceTensor)
    host = torch.tensor([0, 5, 9])
    shapes = KDAShapes(B=1, T=9, H=2, HV=2, K=16, V=16, N=1)
    _DeviceTensor.copies = 0
    for _ in range(3):  # a model's layers sharing one batch's cu_seqlens
        assert check_cu_seqlens(shapes, cu, host, torch.device("cuda")).N == 2
    assert _DeviceTensor.copies == 1
    with pytest.raises(ValueError, match="must equal `cu_seqlens`"):
        check_cu_seqlens(shapes, cu, torch.tensor([0, 4, 9]), torch.device("cuda"))
    assert _DeviceTensor.copies == 2, "new CPU values: the device is read again"
    for _ in range(2):
        host_cu_seqlens(cu)  # no CPU copy to key on: read every time
    assert _DeviceTensor.copies == 4


@pytest.mark.parametrize("with_cpu_copy", [False, True])
def test_v2_layout_of_an_inference_cu_seqlens_is_kept_with_its_cpu_copy(with_cpu_copy):
    from flashkda.fwd.v2.workspace32 import build_chunk_layout32, cached_chunk_layout32

    with torch.inference_mode():
        cu = torch.tensor([0, 70, 70, 130], dtype=torch.int32)
        host = cu.to(torch.int64) if with_cpu_copy else None
        first = cached_chunk_layout32(1, 130, cu, torch.device("cpu"), host)
        again = cached_chunk_layout32(1, 130, cu, torch.device("cpu"), host)
    assert (again is first) == with_cpu_copy
    fresh = build_chunk_layout32(1, 130, cu, torch.device("cpu"))
    assert again.num_chunks == fresh.num_chunks and torch.equal(again.chunk_index, fresh.chunk_index)
