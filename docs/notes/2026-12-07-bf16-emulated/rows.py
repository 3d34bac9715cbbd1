import time, statistics
import torch
from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load
torch.set_num_threads(1)
nat = load(k.SOURCE, k.flags(k.NATIVE), k.SIGNATURES, k.HEADERS); nat.hm_fma_pairs_check()
N, K, copies = 4096, 2048, 8
ws = [torch.randn(N, K).bfloat16() for _ in range(copies)]
for M in (2, 3, 4, 6, 8, 12, 15, 16, 24, 32, 48, 64):
    x = torch.randn(M, K).bfloat16(); y = torch.empty(M, N)
    res = {}
    for rnd in range(3):
        for p in (1, 0):
            nat.hm_set_fma_pairs(p); ts = []
            for r in range(32):
                w = ws[r % copies]; t = time.perf_counter()
                nat.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), K, y.data_ptr(), N, N, K, M); ts.append(time.perf_counter() - t)
            res.setdefault(p, []).append(statistics.median(ts[8:]))
    a, b = min(res[1]), min(res[0])
    print(f"M={M:3d} pairs {a*1e3:.3f} ms  vdpbf16ps {b*1e3:.3f} ms  pairs/vdp {a/b:.2f}", flush=True)
