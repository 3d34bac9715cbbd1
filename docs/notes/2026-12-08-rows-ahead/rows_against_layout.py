"""GGUF's rows against the same rows interleaved (for_kernels), 2048 x 2048 from L2, one thread, 1 to 256
tokens: PYTHONPATH=. [HYBRIDMOE_QUANT_ISA=avx2] python rows_against_layout.py"""
import sys, time, torch
from hybridmoe.quant.tensor import QTensor, for_kernels
from hybridmoe.native import quant
torch.set_num_threads(1)
N, K = 2048, 2048
for fmt in ("q4_k", "q6_k", "q8_0"):
    plain = QTensor.quantize(torch.randn(N, K) * 0.02, fmt); x8 = for_kernels(QTensor(plain.data.clone(), plain.fmt, K))
    out = []
    for M in (1, 8, 64, 256):
        x = torch.randn(M, K).to(torch.bfloat16)
        def t(w):
            best = 1e9
            for _ in range(10):
                t0 = time.perf_counter(); quant.linear(x, w.fmt.ggml, w.data, K); best = min(best, time.perf_counter() - t0)
            return best
        a, b = t(plain), t(x8)
        out.append(f"M{M}: rows {a*1e3:.2f} x8 {b*1e3:.2f} ({a/b:.1f}x)")
    print(fmt, " | ".join(out))
