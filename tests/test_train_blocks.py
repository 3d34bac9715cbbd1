"""The hand-written backward passes of a training step's dense pieces equal autograd's over the
plain ops they replace, on fresh random inputs."""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.layers.lora import LoRA, RowAdapters, using
from hybridmoe.layers.mlp import GatedMLP, silu_mul
from hybridmoe.layers.norm import RMSNorm, through_norm
from hybridmoe.layers.packed_attention import packed_attention


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_equals_sdpa_per_sequence_with_its_gradients(dtype):
    g = torch.Generator().manual_seed(2)
    lens = [5, 40, 17, 17, 17, 9, 40, 40]  # runs of one length go through the kernel as a batch
    T = sum(lens)
    q = torch.randn(T, 6, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(T, 2, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(T, 2, 16, generator=g).to(dtype).requires_grad_()
    up = torch.randn(T, 6, 16, generator=g).to(dtype)
    got = packed_attention(q, k, v, lens, 0.25)
    (got * up).sum().backward()
    got_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    parts, start = [], 0
    for n in lens:  # each sequence alone, causal, heads grouped as transformers' repeat_kv
        s = slice(start, start + n)
        kk, vv = (t[s].repeat_interleave(3, dim=1).transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1), kk, vv, is_causal=True, scale=0.25)
        parts.append(o.transpose(0, 1))
        start += n
    want = torch.cat(parts)
    (want * up).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), atol=tol)
    for a, t in zip(got_grads, (q, k, v)):
        assert torch.allclose(a.float(), t.grad.float(), rtol=tol, atol=tol)


def _adapted_mlp(g):
    """A GatedMLP with a LoRA of random B on each projection, and the rows that use it."""
    mlp = GatedMLP(12, 20, keep=True)
    mlp.requires_grad_(False)
    for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        p.weight.copy_(torch.randn(p.weight.shape, generator=g) * 0.3)
        lora = LoRA(p.in_features, p.out_features, 4, 8.0)
        lora.reset(g)
        with torch.no_grad():
            lora.lora_B.normal_(0, 0.2, generator=g)
        p.adapters = {"a": lora}
    return mlp


def test_norm_rows_made_again_and_row_scale_taken_in_keep_the_gradients():
    """through_norm (the normed rows made again in the backward) and GatedMLP's row scale taken
    into the down input give autograd's gradients over the plain forward, scale * mlp(norm(x))."""
    g = torch.Generator().manual_seed(3)
    norm, mlp = RMSNorm(12, 1e-5), _adapted_mlp(g)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=g))
    x = torch.randn(9, 12, generator=g).requires_grad_()
    w = torch.randn(12, 1, generator=g)
    up = torch.randn(9, 12, generator=g)
    loras = [p.adapters["a"] for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    factors = [t for lora in loras for t in (lora.lora_A, lora.lora_B)]

    def grads(forward):
        with using(RowAdapters.all("a", 9)):
            (forward() * up).sum().backward()
        out = [t.grad.clone() for t in (x, *factors)]
        for t in (x, *factors):
            t.grad = None
        return out

    got = grads(lambda: through_norm(norm, x, lambda h: mlp(h, scale=torch.sigmoid(h @ w))))

    def plain():
        h = norm(x)
        gate, up_ = mlp.gate_proj(h), mlp.up_proj(h)
        return torch.sigmoid(h @ w) * mlp.down_proj(F.silu(gate) * up_)

    want = grads(plain)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
