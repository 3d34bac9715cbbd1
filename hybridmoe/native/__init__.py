"""Native C kernels, compiled with the system C compiler at first use (build.py): the bf16 kernels
for decode and attention (bf16.py over bf16.c). Callers use them through this package's names."""

from hybridmoe.native.bf16 import (
    MAX_ROWS,
    applies,
    attention_applies,
    available,
    cpu_has_avx512_bf16,
    cpu_has_native_bf16,
    decode_attention,
    expert,
    experts,
    gemm,
    prefill_applies,
    prefill_attention,
)

__all__ = [
    "MAX_ROWS",
    "applies",
    "attention_applies",
    "available",
    "cpu_has_avx512_bf16",
    "cpu_has_native_bf16",
    "decode_attention",
    "expert",
    "experts",
    "gemm",
    "prefill_applies",
    "prefill_attention",
]
