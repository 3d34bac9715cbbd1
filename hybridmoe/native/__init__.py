"""Native single-token bf16 kernels (bf16.c), compiled with the system C compiler at first use.

One decode token multiplies one row by every weight, so decode speed is the speed at which weights
stream from RAM; oneDNN's bf16 matrix-vector path reads them at about half of what one core can
(docs/benchmarks.md, issue 2). The kernels need AVX512-BF16 and a C compiler; without either, or
with HYBRIDMOE_NATIVE=0, `available()` is False and callers keep torch's path. The shared library
is cached per source and compiler flags in the user cache directory, written atomically.

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
    lib.hm_gemv_bf16.argtypes = [p, p, p, n, n]
    lib.hm_expert_bf16.argtypes = [p, p, p, p, n, n, p, p]
    lib.hm_gemv_bf16.restype = lib.hm_expert_bf16.restype = None
    return lib


def available() -> bool:
    return library() is not None


def applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernels take this call: one bf16 row on the CPU, contiguous bf16 weights."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu" for w in weights)
            and available())


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K] with one row, weight: [N, K], both bf16 -> [N] fp32, accumulated in fp32."""
    x = x.reshape(-1).contiguous()  # [K]
    n, k = weight.shape
    y = torch.empty(n, dtype=torch.float32)  # [N]
    library().hm_gemv_bf16(weight.data_ptr(), x.data_ptr(), y.data_ptr(), n, k)
    return y


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One token through a SwiGLU expert: x: [H] bf16, gate_up: [2I, H], down: [H, I] -> [H] fp32."""
    x = x.reshape(-1).contiguous()  # [H]
    hidden, inter = down.shape
    y = torch.empty(hidden, dtype=torch.float32)  # [H]
    scratch = torch.empty(2 * inter, dtype=torch.float32)  # [2I]: gate and up, fp32
    h = torch.empty(inter, dtype=torch.bfloat16)  # [I]: silu(gate) * up, the down projection's input
    library().hm_expert_bf16(gate_up.data_ptr(), down.data_ptr(), x.data_ptr(), y.data_ptr(), hidden, inter,
                             scratch.data_ptr(), h.data_ptr())
    return y
