"""The small per-row operations of rows.c (RMSNorm, rotary embedding, a router's softmax and top-k)
on the CPU.

A decode step of a narrow model (the demo model: 576 wide, 30 layers) spends more time calling
torch than computing: RMSNorm is nine torch calls, the rotary embedding about ten, at a few
microseconds each, about what the arithmetic of a whole row costs. Here each is one call, with
torch's roundings (rows.c says where one result may differ in its last bit). Plain C, built for any
x86-64 CPU; HYBRIDMOE_NATIVE=0 switches it off like the other kernels, and callers keep torch's
path (also while gradients are recorded: these have no backward).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from hybridmoe.native.build import INT, F, N, P, load

SOURCE = Path(__file__).with_name("rows.c")
HEADERS = (Path(__file__).with_name("rows.h"),)
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off"]

SIGNATURES = {
    # void hm_rmsnorm_bf16(const uint16_t *X, long ldx, const uint16_t *W, uint16_t *Y, long ldy,
    #                      long R, long n, float eps)
    "hm_rmsnorm_bf16": ([P, N, P, P, N, N, N, F], None),
    # void hm_rotary_bf16(const uint16_t *X, long ldt, long ldh, long T, long H, long d,
    #                     const float *C, const float *S, long ldc, uint16_t *Y)
    "hm_rotary_bf16": ([P, N, N, N, N, N, P, P, N, P], None),
    # int hm_softmax_topk(const void *L, int is_bf16, long ld, long T, long E, long K, int renorm,
    #                     int64_t *ids, float *w)
    "hm_softmax_topk": ([P, INT, N, N, N, N, INT, P, P], INT),
}


@lru_cache(maxsize=1)
def library():
    """The compiled functions, or None (native code off, no compiler)."""
    return load(SOURCE, FLAGS, SIGNATURES, HEADERS)


def _takes(*tensors: torch.Tensor) -> bool:
    return (
        all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
        and not torch.is_grad_enabled()
        and library() is not None
    )


def rmsnorm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rmsnorm takes these: bf16 on the CPU, the weight contiguous, no gradients."""
    return _takes(x, weight) and weight.is_contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] bf16, weight [n] bf16 -> weight * bf16(x * rsqrt(mean(x^2) + eps)) [..., n]."""
    n = x.shape[-1]
    rows = x.reshape(-1, n) if x.stride(-1) == 1 else x.contiguous().view(-1, n)  # [R, n]
    if rows.shape[0] > 1 and rows.stride(0) < n:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16)  # [..., n]
    library().hm_rmsnorm_bf16(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), y.data_ptr(), n, rows.shape[0], n, eps
    )
    return y


def rotary_applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rotary takes these: x [T, H, d] bf16 with unit stride along d, cos/sin [T, d] fp32
    with unit stride, on the CPU, no gradients."""
    return (
        x.dim() == 3
        and x.stride(-1) == 1
        and cos.shape == (x.shape[0], x.shape[2])
        and cos.dtype == torch.float32
        and cos.device.type == "cpu"
        and cos.stride(-1) == 1
        and _takes(x)
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] bf16, cos/sin [T, d] fp32 (same strides) -> x * cos + rotate_half(x) * sin
    [T, H, d] bf16, rounded as torch rounds it on bf16 tensors."""
    t, h, d = x.shape
    y = torch.empty(t, h, d, dtype=torch.bfloat16)  # [T, H, d]
    library().hm_rotary_bf16(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        t,
        h,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        y.data_ptr(),
    )
    return y


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [T, E] (bf16 or fp32, rows of unit stride, on the CPU) -> ids [T, k] int64, weights
    [T, k] fp32: rows.h route_row for each row, one call; None where it does not apply (native
    code off, gradients wanted of the logits, another dtype or layout) or a logit is not finite."""
    if (
        logits.dim() != 2
        or logits.dtype not in (torch.bfloat16, torch.float32)
        or logits.device.type != "cpu"
        or logits.stride(-1) != 1
        or (logits.requires_grad and torch.is_grad_enabled())
        or not 0 < k <= logits.shape[1]
        or library() is None
    ):
        return None
    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int64)  # [T, k]
    weights = torch.empty(t, k, dtype=torch.float32)  # [T, k]
    bad = library().hm_softmax_topk(
        logits.data_ptr(),
        int(logits.dtype == torch.bfloat16),
        logits.stride(0),
        t,
        e,
        k,
        int(renormalize),
        ids.data_ptr(),
        weights.data_ptr(),
    )
    return None if bad else (ids, weights)
