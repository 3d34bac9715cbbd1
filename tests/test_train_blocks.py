"""The hand-written backward passes of a training step's dense pieces equal autograd's over the
plain ops they replace, on fresh random inputs."""

import pytest
import torch

from hybridmoe.layers.mlp import silu_mul
from hybridmoe.layers.norm import RMSNorm


def plain_rms_norm(x, weight, eps):
    """Hugging Face's RMSNorm, op by op, for autograd to differentiate."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_equals_autograd_over_its_ops(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    x = torch.randn(7, 24, generator=g).to(dtype).requires_grad_()
    up = torch.randn(7, 24, generator=g).to(dtype)  # dLoss/d(output)
    got = norm(x)
    (got * up).sum().backward()
    got_dx, got_dw = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    want = plain_rms_norm(x, norm.weight, 1e-5)
    (want * up).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(got.detach(), want.detach()) or torch.allclose(got, want, atol=tol)
    assert torch.allclose(got_dx.float(), x.grad.float(), rtol=tol, atol=tol)
    assert torch.allclose(got_dw.float(), norm.weight.grad.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_backward_equals_autograd_over_its_ops(dtype):
    g = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(9, 16, generator=g)).to(dtype).requires_grad_()
    up = torch.randn(9, 16, generator=g).to(dtype).requires_grad_()
    dh = torch.randn(9, 16, generator=g).to(dtype)
    (silu_mul(gate, up) * dh).sum().backward()
    got = gate.grad.clone(), up.grad.clone()
    gate.grad, up.grad = None, None
    (torch.nn.functional.silu(gate) * up * dh).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, (gate.grad, up.grad)):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
