"""bf16 values of chosen exponents and a bit-for-bit comparison with NaN taken as NaN: the inputs
and the check of the tests that hold bf16 kernels' paths and builds against each other
(test_native.py, test_bf16_isa.py)."""

from __future__ import annotations

import torch


def bf16_with_exponents(shape, lo: int, hi: int, gen, signed: bool = True) -> torch.Tensor:
    """bf16 values of random mantissa (and sign, if `signed`) whose exponent field is in [lo, hi]
    (0: subnormal)."""
    n = int(torch.Size(shape).numel())
    sign_mantissa = torch.randint(0, 1 << 16, (n,), generator=gen) & (0x807F if signed else 0x7F)
    exponent = torch.randint(lo, hi + 1, (n,), generator=gen) << 7
    return (sign_mantissa | exponent).to(torch.int16).view(torch.bfloat16).view(shape)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal fp32 bits wherever either is a number, NaN where both are (NaN payloads may differ)."""
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    return bool(same.all())
