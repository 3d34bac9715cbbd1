"""One-row bf16 products from weights in 2 MB pages (the loader's arena), the row kernel against the
tiles (GB/s, best of 3 alternating). Run at fa32040 (the tiles' products) as products_ab.py."""
import torch, time, sys
from hybridmoe.native import bf16 as nb
torch.set_num_threads(1)
lib = nb.library()
for O, I in [(49152, 576), (4096, 2048), (576, 576)]:
    n = max(2, 300_000_000 // (2 * O * I))
    from hybridmoe.native.huge_pages import arena
    ws = [arena().copy((torch.randn(O, I) * 0.05).bfloat16()) for _ in range(n)]
    x = torch.randn(1, I).bfloat16(); y = torch.empty(1, O)
    res = {}
    for on in (False, True) * 3:
        nb.use_amx(on)
        t0 = time.perf_counter()
        for w in ws: lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), I, y.data_ptr(), O, O, I, 1)
        res.setdefault(on, []).append(n * 2 * O * I / (time.perf_counter() - t0) / 1e9)
    print(O, I, 'avx %.2f  amx %.2f GB/s' % (max(res[False]), max(res[True])))
