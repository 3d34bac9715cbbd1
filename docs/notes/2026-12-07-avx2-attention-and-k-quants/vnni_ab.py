"""Interleaved rows (FMT: q4_k, q5_k, q6_k, q8_0, q4_0, q4_1; random valid blocks, 2048 x 768) on the
AVX2 path against AVX2 with AVX-VNNI, one thread, alternating: one token from RAM (COUNT matrices) and 4,
64, 512 tokens (one matrix, hot); checks both give the same bits.
FMT=q4_k PYTHONPATH=. python vnni_ab.py [COUNT]"""

import os
import statistics
import sys
import time

import numpy as np
import torch

from hybridmoe.native import quant as K
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from tests.test_quant import random_blocks

torch.set_num_threads(1)
f = FORMATS[os.environ.get("FMT", "q4_k")]
x8 = INTERLEAVED[f.name]
N, Kc = 2048, 768
count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
plain = torch.from_numpy(random_blocks(f, N, Kc, np.random.default_rng(0)))
mats = [plain.clone() for _ in range(count)]
for m in mats:
    K.interleave_rows(m, f.ggml, Kc)
x = torch.randn(1, Kc)
paths = (("avx2", K.AVX2), ("avxvnni", K.AVXVNNI))
outs = [K.linear(x, x8.ggml, mats[0], Kc, p, 1) for _, p in paths]
assert torch.equal(*outs)
gb = plain.numel() * count / 1e9
for _ in range(3):
    for name, p in paths:
        t0 = time.perf_counter()
        for m in mats:
            K.linear(x, x8.ggml, m, Kc, p, 1)
        print(f"{f.name} one token from RAM {name}: {gb / (time.perf_counter() - t0):.1f} GB/s")
for M in (4, 64, 512):
    xm = torch.randn(M, Kc)
    assert torch.equal(*[K.linear(xm, x8.ggml, mats[0], Kc, p, 1) for _, p in paths])
    for _ in range(2):
        for name, p in paths:
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                K.linear(xm, x8.ggml, mats[0], Kc, p, 1)
                ts.append(time.perf_counter() - t0)
            print(f"{f.name} {M} tokens {name}: {1e3 * statistics.median(ts):.3f} ms")
