"""Time of products of M (default 512) tokens on rows in sixteens, 1 thread: tiles_time.py FMTS [M]."""
import sys, time, torch, numpy as np
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.interleave import interleave
from tests.test_quant import random_blocks
torch.set_num_threads(1)
fmts = sys.argv[1].split(",")
shapes = [(768, 2048), (2048, 768)]
M = int(sys.argv[2]) if len(sys.argv) > 2 else 512
for fmt in fmts:
    for n, k in shapes:
        plain = torch.from_numpy(random_blocks(FORMATS[fmt], n, k, np.random.default_rng(1)))
        x16 = interleave(plain, fmt)
        x = torch.randn(M, k).to(torch.bfloat16)
        ts = []
        for i in range(15):
            t = time.perf_counter(); kernels.linear(x, INTERLEAVED[fmt].ggml, x16, k, None, 1); ts.append(time.perf_counter() - t)
        print(fmt, n, k, M, f"{np.median(ts)*1e3:.2f} ms  min {min(ts)*1e3:.2f}")
