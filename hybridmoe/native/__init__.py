"""Native bf16 decode kernels (bf16.c), compiled with the system C compiler at first use.

A decode step multiplies a few rows (one per sequence) by every weight, so decode speed is the speed
at which weights stream from RAM; oneDNN's bf16 path reads them at about half of what one core can
(docs/benchmarks.md, issue 2), and pays ~15 us a call. The kernels read each weight once for up to
MAX_ROWS rows. They need AVX512-BF16 and a C compiler; without either, or with HYBRIDMOE_NATIVE=0,
`available()` is False and callers keep torch's path. The shared library is cached per source and
compiler flags in the user cache directory, written atomically.

At the package's top: layers/ (dense projections, layers/linear.py) and experts/ (expert FFNs)
both use it.
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


def cpu_has_avx512_bf16() -> bool:
    """From /proc/cpuinfo (Linux); elsewhere False, which keeps torch's path."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


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
    return lib


def available() -> bool:
    return library() is not None


def applies(x: torch.Tensor, *weights: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the kernels take this call: up to max_rows bf16 rows on the CPU, contiguous bf16 weights."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() <= max_rows * x.shape[-1]
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu" for w in weights)
            and available())


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
