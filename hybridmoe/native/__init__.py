"""Native bf16 decode kernels (bf16.c), compiled with the system C compiler at first use.

A decode step multiplies a few rows (one per sequence) by every weight, so decode speed is the speed
at which weights stream from RAM; oneDNN's bf16 path reads them at about half of what one core can
(docs/benchmarks.md, issue 2), and pays ~15 us a call. The kernels read each weight once for up to
MAX_ROWS rows. They need AVX512-BF16 and a C compiler; without either, or with HYBRIDMOE_NATIVE=0,
`available()` is False and callers keep torch's path. The shared library is cached per source and
compiler flags in the user cache directory, written atomically.

At the package's top: layers/ (dense projections, layers/linear.py; decode and prefill attention,
layers/attention.py) and experts/ (expert FFNs) use it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from hybridmoe.paths import user_cache_dir

SOURCE = Path(__file__).with_name("bf16.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC"]

# Rows up to which the kernels take a call. One thread, weights from RAM (2-core Zen 4, 2026-11-21):
# the kernel is faster than torch's oneDNN bf16 linear at every row count up to 32 for the demo
# model's shapes and a wider one ([32, 576] x [49152, 576]^T: 6.3 vs 7.1 ms; [32, 2048] x [1536, 2048]^T:
# 0.64 vs 0.74 ms; [32, 48] x [576, 48]^T: 19.8 vs 21.5 us) and about even at 48
# (9.0 vs 9.0 ms, 24 vs 23 us), where it is compute-bound. Beyond, prefill keeps oneDNN.
MAX_ROWS = 32


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); elsewhere none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_avx512_bf16() -> bool:
    """What these kernels need; without it torch's path runs."""
    return "avx512_bf16" in _cpu_flags()


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), so oneDNN's bf16 matrix
    products beat fp32 ones; without it torch emulates bf16, slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def _compile(out: Path) -> None:
    """cc FLAGS bf16.c -o out, through a temporary file in out's directory and a rename."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here (see the module's docstring)."""
    if os.environ.get("HYBRIDMOE_NATIVE", "1") == "0" or not cpu_has_avx512_bf16():
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = user_cache_dir() / "native" / f"bf16-{key}.so"
    try:
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.hm_gemm_bf16.argtypes = [p, p, n, p, n, n, n, n]
    lib.hm_expert_rows_bf16.argtypes = [p, p, p, n, p, n, n, n, n, p, p]
    lib.hm_gemm_bf16.restype = lib.hm_expert_rows_bf16.restype = None
    lib.hm_decode_attention_bf16.argtypes = [p, n, p, n, p, n, p, p, p, p, n, n, n, n, n, n, ctypes.c_float, p, n,
                                             ctypes.c_int]
    lib.hm_decode_attention_bf16.restype = ctypes.c_int
    lib.hm_prefill_attention_bf16.argtypes = [p, n, n, p, n, n, p, n, n, n, n, n, n, n, n, ctypes.c_float, p, n,
                                              ctypes.c_int]
    lib.hm_prefill_attention_bf16.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def _bf16_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def applies(x: torch.Tensor, *weights: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the kernels take this call: up to max_rows bf16 rows on the CPU, contiguous bf16 weights."""
    return (_bf16_on_cpu(x, *weights) and x.numel() <= max_rows * x.shape[-1]
            and all(w.is_contiguous() for w in weights) and available())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] as [M, K] with unit stride along K (rows may be further apart than K). Checked
    before reshaping: each torch call costs about 1 us, as much as a small kernel."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])  # [M, K]
    return x if x.stride(-1) == 1 else x.contiguous()


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K] with M rows, weight: [N, K], both bf16 -> [M, N] fp32, accumulated in fp32."""
    x = _rows(x)  # [M, K]
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)  # [M, N]
    library().hm_gemm_bf16(weight.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(), n, n, k, x.shape[0])
    return y


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """M tokens through a SwiGLU expert: x: [M, H] bf16, gate_up: [2I, H], down: [H, I] -> [M, H] fp32."""
    x = _rows(x)  # [M, H]
    m, (hidden, inter) = x.shape[0], down.shape
    y = torch.empty(m, hidden, dtype=torch.float32)  # [M, H]
    scratch = torch.empty(m, 2 * inter, dtype=torch.float32)  # [M, 2I]: gate and up, fp32
    h = torch.empty(m, inter, dtype=torch.bfloat16)  # [M, I]: silu(gate) * up, the down projection's input
    library().hm_expert_rows_bf16(gate_up.data_ptr(), down.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
                                  hidden, m, hidden, inter, scratch.data_ptr(), h.data_ptr())
    return y


def attention_applies(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether decode_attention takes these: bf16 queries and pools on the CPU, the pools' rows contiguous."""
    return _bf16_on_cpu(q, k_pool, v_pool) and k_pool.is_contiguous() and v_pool.is_contiguous() and available()


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     table_starts: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, block_size: int,
                     scale: float, out: torch.Tensor) -> None:
    """Attention of one query token per sequence over its paged history, into out's rows.

    q: [T, h, d] bf16; k_pool: [slots, kvh, d], v_pool: [slots, kvh, dv] bf16; out: [T, h, dv] bf16 or
    fp32, rows contiguous. Sequence s (int32 tensors [S]): query and output row rows[s], positions
    0..lengths[s]-1, position l at slot table[l // block_size] * block_size + l % block_size where
    table = tables[table_starts[s]:]. Scores and sums in fp32; query head i uses KV head i // (h // kvh).
    """
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    heads, d = q.shape[1:]
    kv_heads, dv = v_pool.shape[1:]
    assert out.stride(-1) == 1 and out.stride(-2) == dv and heads % kv_heads == 0
    status = library().hm_decode_attention_bf16(
        q.data_ptr(), q.stride(0), k_pool.data_ptr(), k_pool.stride(0), v_pool.data_ptr(), v_pool.stride(0),
        tables.data_ptr(), table_starts.data_ptr(), lengths.data_ptr(), rows.data_ptr(), len(rows), block_size,
        heads, kv_heads, d, dv, scale, out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16)
    if status != 0:
        raise MemoryError("decode attention: no memory for its scratch")


def prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether prefill_attention takes these: bf16 on the CPU, unit stride along the head dimension."""
    return _bf16_on_cpu(q, k, v) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and available()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Causal attention of a chunk: q [n, h, d], k [L, kvh, d], v [L, kvh, dv] bf16 -> [n, h, dv] out_dtype
    (bf16 or fp32).

    The n queries are the last n of the L positions; query head i uses KV head i // (h // kvh). Scores,
    softmax and sums in fp32; a bf16 result is the fp32 one rounded once. k and v may be strided views
    (a pool's rows): the kernel packs each KV head once per call anyway.
    """
    n, heads, d = q.shape
    length, kv_heads, dv = v.shape
    assert heads % kv_heads == 0 and k.shape[:2] == (length, kv_heads) and k.shape[2] == d
    out = torch.empty(n, heads, dv, dtype=out_dtype)  # [n, h, dv]
    status = library().hm_prefill_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), n, length, heads, kv_heads, d, dv, scale, out.data_ptr(), heads * dv,
        out_dtype == torch.bfloat16)
    if status != 0:
        raise MemoryError("prefill attention: no memory for its scratch")
    return out
