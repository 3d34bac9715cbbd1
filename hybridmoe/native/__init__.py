"""Native C kernels, compiled with the system C compiler at first use (build.py): the bf16 kernels
for decode and attention (bf16.py over bf16.c). Callers use them through this package's names.

The names load bf16.py (and torch) when first read, so that the torch-free modules beside it
(build.py, predictor_kernels.py: the planner's) import without torch."""

__all__ = [
    "MAX_ROWS",
    "applies",
    "attention_applies",
    "available",
    "cpu_runs_kernels",
    "cpu_has_avx512_bf16",
    "cpu_has_native_bf16",
    "DECODE_FIELDS",
    "DECODE_KIND",
    "EXPERTS_BF16",
    "EXPERTS_IN_BLOCKS",
    "EXPERTS_SHARED",
    "decode_attention",
    "decode_layers",
    "decoder_attention",
    "expert",
    "f32_bits",
    "experts",
    "gemm",
    "kernels_beat_onednn",
    "moe_tokens",
    "linear",
    "prefill_applies",
    "prefill_attention",
    "shared_moe_token",
    "weights_apply",
]


def __getattr__(name: str):
    if name in __all__:
        from hybridmoe.native import bf16

        value = globals()[name] = getattr(bf16, name)  # bound once, as an import binds it
        return value
    raise AttributeError(f"module 'hybridmoe.native' has no attribute {name!r}")
