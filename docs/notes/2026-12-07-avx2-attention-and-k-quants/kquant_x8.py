"""A K-quant (FMT: q4_k, q5_k or q6_k; random valid blocks) 2048 x 768, one token from RAM (COUNT
matrices, ~0.3-0.4 MB each) and 4, 64, 512 tokens (one matrix, hot), GGUF rows against rows in
eights on the AVX2 path, one thread, alternating; checks both give the same bits.
HYBRIDMOE_QUANT_ISA=avx2 FMT=q6_k PYTHONPATH=. python kquant_x8.py [COUNT]"""
import statistics, sys, time, torch
from hybridmoe.native import quant as K
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
torch.set_num_threads(1)
import os
FMT = os.environ.get("FMT", "q6_k")
f, x8 = FORMATS[FMT], INTERLEAVED[FMT]
N, Kc = 2048, 768
import numpy as np
from tests.test_quant import random_blocks
plain = torch.from_numpy(random_blocks(f, N, Kc, np.random.default_rng(0)))
count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
mats = [plain.clone() for _ in range(count)]
mats8 = [m.clone() for m in mats]
for m in mats8: K.interleave_rows(m, f.ggml, Kc)
x = torch.randn(1, Kc)
ref = K.linear(x, f.ggml, mats[0], Kc, K.AVX2, 1); got = K.linear(x, x8.ggml, mats8[0], Kc, K.AVX2, 1)
assert torch.equal(ref, got)
gb = plain.numel() * count / 1e9
for rnd in range(3):
    for name, fmt, ms in (("gguf", f.ggml, mats), ("x8", x8.ggml, mats8)):
        t0 = time.perf_counter()
        for m in ms: K.linear(x, fmt, m, Kc, K.AVX2, 1)
        dt = time.perf_counter() - t0
        print(f"one token from RAM {name}: {gb/dt:.1f} GB/s")
for M in (4, 64, 512):
    xm = torch.randn(M, Kc)
    for rnd in range(2):
        for name, fmt, m in (("gguf", f.ggml, mats[0]), ("x8", x8.ggml, mats8[0])):
            ts = []
            for _ in range(5):
                t0 = time.perf_counter(); K.linear(xm, fmt, m, Kc, K.AVX2, 1); ts.append(time.perf_counter() - t0)
            print(f"{M} tokens {name}: {1e3*statistics.median(ts):.2f} ms")
