"""Ours (hm_qlinear, the many-token path) against dequantise + oneDNN (QTensor.dequantize to bf16,
then F.linear), 1 thread, 512 tokens, alternating, medians of 7, ms."""
import statistics, sys, time, torch
import torch.nn.functional as F
from hybridmoe.native import quant as K
from hybridmoe.quant.tensor import QTensor, for_kernels
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
M = 512
for fmt in ("q4_k", "q8_0", "q6_k"):
    for N, Kc in ((768, 2048), (2048, 768), (2048, 4096)):
        plain = QTensor.quantize(torch.randn(N, Kc) * 0.02, fmt)  # GGUF's layout, for the C dequantiser
        w = for_kernels(QTensor(plain.data.clone(), plain.fmt, Kc))
        ids = torch.arange(N)
        x = torch.randn(M, Kc).bfloat16()
        a, b, c = [], [], []
        for _ in range(8):
            t = time.perf_counter(); K.linear(x, w.fmt.ggml, w.data, Kc, workers=torch.get_num_threads()); a.append(time.perf_counter() - t)
            t = time.perf_counter(); F.linear(x, w.dequantize(torch.bfloat16)); b.append(time.perf_counter() - t)
            t = time.perf_counter(); F.linear(x, K.rows(plain.data, plain.fmt.ggml, Kc, ids, torch.bfloat16)); c.append(time.perf_counter() - t)
        ma, mb, mc = (statistics.median(v[1:]) * 1e3 for v in (a, b, c))
        print(f"| {fmt} {N}x{Kc} | {ma:.2f} | {mb:.2f} | {mc:.2f} | {min(mb, mc) / ma:.2f}x |")
