"""Tiles on and off at 16 and 32 tokens, alternating, on rows in sixteens."""
import time, torch, numpy as np, statistics
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.interleave import interleave
from tests.test_quant import random_blocks
torch.set_num_threads(1)
for fmt in ("q8_0","q4_0"):
  for n, k in ((768, 2048), (2048, 768)):
    plain = torch.from_numpy(random_blocks(FORMATS[fmt], n, k, np.random.default_rng(1)))
    x16 = interleave(plain, fmt)
    for M in (16, 32):
        x = torch.randn(M, k).to(torch.bfloat16)
        res = {True: [], False: []}
        for r in range(9):
            for on in (True, False):
                kernels.use_tiles(on)
                t = time.perf_counter()
                for _ in range(10): kernels.linear(x, INTERLEAVED[fmt].ggml, x16, k, None, 1)
                res[on].append((time.perf_counter() - t) / 10)
        print(fmt, n, k, M, "tiles %.3f vnni %.3f ms" % (statistics.median(res[True])*1e3, statistics.median(res[False])*1e3))
kernels.use_tiles(True)
