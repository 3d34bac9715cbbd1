"""Interleaved A/B of quant.c variants: each variant .so loaded in this process, the one-token
product over a cold set of matrices, variants alternating every pass; medians per variant.
Usage: PYTHONPATH=. python ab_quant.py A.c,B.c FORMAT N K [THREADS] [MATRICES]
(A.c, B.c: copies of quant.c)."""

import ctypes
import statistics
import subprocess
import sys
import time

import torch

from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor, for_kernels

srcs = sys.argv[1].split(",")
fmt_name = sys.argv[2]
N, K = int(sys.argv[3]), int(sys.argv[4])
T = int(sys.argv[5]) if len(sys.argv) > 5 else 1
libs = []
for i, s in enumerate(srcs):
    out = f"/tmp/prof/v{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", s, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    f = lib.hm_qlinear
    f.argtypes, f.restype = qn.SIGNATURES["hm_qlinear"]
    libs.append(f)
torch.manual_seed(0)
mats = [
    for_kernels(QTensor.quantize(torch.randn(N, K) * 0.02, fmt_name))
    for _ in range(int(sys.argv[6]) if len(sys.argv) > 6 else 64)
]
x = torch.randn(1, K).to(torch.bfloat16)
y = torch.empty(1, N)
res = [[] for _ in libs]
for _ in range(25):
    for i, f in enumerate(libs):
        t0 = time.perf_counter_ns()
        for m in mats:
            f(
                m.fmt.ggml,
                m.data.data_ptr(),
                m.data.stride(0),
                N,
                K,
                x.data_ptr(),
                K,
                1,
                1,
                y.data_ptr(),
                N,
                T,
                2,
            )
        res[i].append((time.perf_counter_ns() - t0) / len(mats) / 1e3)
nb = mats[0].data.numel()
for s, r in zip(srcs, res):
    med = statistics.median(r)
    print(
        f"{s}: {med:.1f} us/matrix, {nb / med / 1e3:.2f} GB/s (q1 {statistics.quantiles(r)[0]:.1f})"
    )
