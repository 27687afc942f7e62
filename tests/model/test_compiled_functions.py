"""The model's hand-written autograd Functions give their eager gradients when ``torch.compile`` traces them, in
fp32 as well as bf16 (torch 2.11's compiler zeroes the gradients of a Function whose forward returns a tensor it
wrote in place or an alias of its own intermediate; this fails there without `layers._forward_output`)."""

import pytest
import torch

from k3infra.model import layers


def _rms(x, w):
    return layers._RMSNormFunction.apply(x, w, 1e-5)


def _situ(a, c):
    return layers._SiTUGLUFunction.apply(a, c, 4.0, 25.0)


def _attn_res(query, norm_weight, *sources):
    return layers._AttnResFunction.apply(query, norm_weight, 1e-6, *sources)


def _inputs(name, dtype, g):
    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    if name == "rms":
        return [rn(2, 9, 32), rn(32)]
    if name == "situ":
        return [rn(18, 32, scale=3.0), rn(18, 32, scale=10.0)]
    return [rn(32), rn(32), rn(2, 9, 32), rn(2, 9, 32), rn(2, 9, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, fn", [("rms", _rms), ("situ", _situ), ("attn_res", _attn_res)],
                         ids=["rms_norm", "situ_glu", "attn_res"])
def test_compiled_function_has_the_eager_gradients(name, fn, dtype):
    g = torch.Generator().manual_seed(11)
    inputs = _inputs(name, dtype, g)
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        y = (torch.compile(fn, backend="aot_eager") if compiled else fn)(*xs)
        assert y.dtype == xs[-1].dtype
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype))
        grads.append([x.grad for x in xs])
    for i, (eager, comp) in enumerate(zip(*grads)):
        assert eager.abs().sum() > 0, f"input {i}: the eager gradient is zero, the check would be empty"
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"input {i}: {m}")
