"""Time one quantised product (native/quant.py linear) of M tokens against an N x K weight, warm (the
same copy) and from RAM (copies rotated past the caches), one thread: PYTHONPATH=. python cold_products.py q6_k 1536x1536"""
import sys, time, torch
from hybridmoe.quant.tensor import QTensor, for_kernels
from hybridmoe.native import quant
torch.set_num_threads(1)
fmt = sys.argv[1]; N, K = map(int, sys.argv[2].split("x"))
copies = [for_kernels(QTensor.quantize(torch.randn(N, K) * 0.02, fmt)) for _ in range(1)]
big = [QTensor(copies[0].data.clone(), copies[0].fmt, copies[0].cols) for _ in range(max(2, int(64e6 // copies[0].data.numel())))]
print(copies[0].fmt.name, copies[0].data.shape, copies[0].data.numel()/1e6, "MB")
g = copies[0].fmt.ggml
def t(M, warm):
    x = torch.randn(M, K).to(torch.bfloat16)
    best = 1e9
    for i in range(30):
        w = copies[0] if warm else big[i % len(big)]
        t0 = time.perf_counter(); quant.linear(x, g, w.data, K); best = min(best, time.perf_counter() - t0)
    return best
for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32):
    a, b = t(M, True), t(M, False)
    print(f"M={M:3d} warm {a*1e6:8.1f} us ({a*1e6/M:6.1f}/tok)  cold {b*1e6:8.1f} us ({b*1e6/M:6.1f}/tok)")
