"""bf16 products (hm_gemm_bf16: block()) of the tree on PYTHONPATH, one thread: M rows from RAM (GB/s,
median of 3) and hot (ms, best of 3 x 10). Run once per tree, alternating:
`OMP_WAIT_POLICY=PASSIVE PYTHONPATH=TREE python products_ab.py` under the heavy lock."""
import json
import sys
import time

import torch

from hybridmoe.native import bf16 as nb
from hybridmoe.native.huge_pages import arena

torch.set_num_threads(1)
lib = nb.library()


def run(x, w, y):
    M, I = x.shape
    O = w.shape[0]
    lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(), O, O, I, M)


out = {}
for O, I in [(576, 576), (768, 2048), (2048, 768)]:
    n = max(2, 300_000_000 // (2 * O * I))
    ws = [arena().copy((torch.randn(O, I) * 0.05).bfloat16()) for _ in range(n)]
    for M in (1, 4, 8, 32):
        x, y = torch.randn(M, I).bfloat16(), torch.empty(M, O)
        r = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w in ws:
                run(x, w, y)
            r.append(n * 2 * O * I / (time.perf_counter() - t0) / 1e9)
        out[f"{O}x{I} M{M} GB/s"] = round(sorted(r)[1], 2)
    for M in (64, 512):
        x, y = torch.randn(M, I).bfloat16(), torch.empty(M, O)
        best = []
        for _ in range(3):
            run(x, ws[0], y)
            t0 = time.perf_counter()
            for _ in range(10):
                run(x, ws[0], y)
            best.append((time.perf_counter() - t0) / 10 * 1e3)
        out[f"{O}x{I} M{M} ms"] = round(min(best), 3)
json.dump(out, sys.stdout)
print()
