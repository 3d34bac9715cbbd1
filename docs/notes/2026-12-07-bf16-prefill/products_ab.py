"""bf16 products, the row kernel (block()) against the tiles, one process, alternating: M rows from RAM
(GB/s) and hot (ms) beside oneDNN. Run at commit fa32040 (3ea2cbf's products on the tiles), where
use_amx switches the products; `python products_ab.py` under the heavy lock."""
import torch, time, sys
from hybridmoe.native import bf16 as nb
torch.set_num_threads(1)
lib = nb.library()
def run(x, w, y):
    M, I = x.shape; O = w.shape[0]
    lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(), O, O, I, M)
for O, I in [(576, 576), (768, 2048), (2048, 768), (1536, 576)]:
    n = max(2, 300_000_000 // (2 * O * I))
    ws = [(torch.randn(O, I) * 0.05).bfloat16() for _ in range(n)]
    for M in (1, 2, 4, 8, 16, 32):
        x = torch.randn(M, I).bfloat16(); y = torch.empty(M, O)
        res = {}
        for on in (False, True, False, True, False, True):
            nb.use_amx(on)
            t0 = time.perf_counter()
            for w in ws: run(x, w, y)
            dt = time.perf_counter() - t0
            res.setdefault('amx' if on else 'avx', []).append(n * 2 * O * I / dt / 1e9)
        print(O, I, 'M', M, {k: round(sorted(v)[1], 2) for k, v in res.items()}, 'GB/s (median of 3)')
    w = ws[0]
    for M in (64, 512):
        x = torch.randn(M, I).bfloat16(); y = torch.empty(M, O)
        res = {}
        for name in ['avx', 'amx', 'onednn'] * 2:
            nb.use_amx(name == 'amx')
            f = (lambda: torch.nn.functional.linear(x, w)) if name == 'onednn' else (lambda: run(x, w, y))
            for _ in range(3): f()
            t0 = time.perf_counter()
            for _ in range(10): f()
            res.setdefault(name, []).append((time.perf_counter() - t0) / 10 * 1e3)
        print(O, I, 'M', M, {k: round(min(v), 3) for k, v in res.items()}, 'ms hot')
