import statistics, sys, time, torch
import torch.nn.functional as F
from hybridmoe.native import quant as K
from hybridmoe.quant.tensor import QTensor, for_kernels
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(T)
torch.manual_seed(0)
for M in (16, 64, 512):
    for N, Kc in ((768, 2048), (2048, 768), (2048, 4096), (4096, 2048)):
        plain = QTensor.quantize(torch.randn(N, Kc) * 0.02, "q4_k")
        w = for_kernels(QTensor(plain.data.clone(), plain.fmt, Kc))
        ids = torch.arange(N)
        x = torch.randn(M, Kc).bfloat16()
        res = {"tiles": [], "vnni": [], "onednn": []}
        for _ in range(6):
            K.use_tiles(True); t = time.perf_counter(); K.linear(x, w.fmt.ggml, w.data, Kc, workers=T); res["tiles"].append(time.perf_counter() - t)
            K.use_tiles(False); t = time.perf_counter(); K.linear(x, w.fmt.ggml, w.data, Kc, workers=T); res["vnni"].append(time.perf_counter() - t)
            t = time.perf_counter(); F.linear(x, K.rows(plain.data, plain.fmt.ggml, Kc, ids, torch.bfloat16)); res["onednn"].append(time.perf_counter() - t)
        m = {k: statistics.median(v[1:]) * 1e3 for k, v in res.items()}
        print(f"| {N}x{Kc} | {M} | {m['vnni']:.2f} | {m['tiles']:.2f} | {m['onednn']:.2f} | {m['vnni'] / m['tiles']:.2f}x | {m['onednn'] / m['tiles']:.2f}x |")
K.use_tiles(True)
