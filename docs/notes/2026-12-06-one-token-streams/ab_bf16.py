"""Interleaved A/B of bf16.c variants: one-row products over a cold set, variants alternating.
Usage: PYTHONPATH=. python ab_bf16.py A.c,B.c N K THREADS MATRICES (copies of bf16.c)."""

import ctypes
import statistics
import subprocess
import sys
import time

import torch

from hybridmoe.native import bf16 as bn

srcs = sys.argv[1].split(",")
N, K = int(sys.argv[2]), int(sys.argv[3])
T = int(sys.argv[4])
cnt = int(sys.argv[5])
libs = []
for i, s in enumerate(srcs):
    out = f"/tmp/prof/b{i}.so"
    subprocess.run(["cc", *bn.FLAGS, f"-I{bn.SOURCE.parent}", s, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    f = lib.hm_linear_bf16
    f.argtypes, f.restype = bn.SIGNATURES["hm_linear_bf16"]
    libs.append(f)
torch.manual_seed(0)
mats = [(torch.randn(N, K) * 0.02).to(torch.bfloat16) for _ in range(cnt)]
x = torch.randn(1, K).to(torch.bfloat16)
y = torch.empty(1, N, dtype=torch.bfloat16)
res = [[] for _ in libs]
for _ in range(15):
    for i, f in enumerate(libs):
        t0 = time.perf_counter_ns()
        for m in mats:
            f(m.data_ptr(), x.data_ptr(), K, 0, y.data_ptr(), N, N, K, 1, T)
        res[i].append((time.perf_counter_ns() - t0) / len(mats) / 1e3)
nb = mats[0].numel() * 2
for s, r in zip(srcs, res):
    med = statistics.median(r)
    print(f"{s}: {med:.1f} us/matrix, {nb / med / 1e3:.2f} GB/s")
