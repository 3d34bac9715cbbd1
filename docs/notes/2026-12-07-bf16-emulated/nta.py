import time, statistics, torch
from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load
torch.set_num_threads(1)
def fl(i, nta): return [f for f in k.flags(i) if not f.startswith("-DWEIGHTS_NTA")] + [f"-DWEIGHTS_NTA={nta}"]
libs = {f"{n} nta={nta}": load(k.SOURCE, fl(i, nta), k.SIGNATURES, k.HEADERS) for n, i in (("native", k.NATIVE), ("emulated", k.EMULATED)) for nta in (1, 0)}
for N, K in ((4096, 576), (4096, 768), (4096, 2048), (49152, 576)):
    n_copies = max(2, (128 << 20) // (2 * N * K))
    ws = [torch.randn(N, K).bfloat16() for _ in range(n_copies)]
    x = torch.randn(1, K).bfloat16(); y = torch.empty(1, N)
    res = {}
    for rnd in range(3):
        for n, lib in libs.items():
            ts = []
            for r in range(100):
                w = ws[r % len(ws)]; t = time.perf_counter()
                lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), K, y.data_ptr(), N, N, K, 1); ts.append(time.perf_counter() - t)
            res.setdefault(n, []).append(statistics.median(ts))
    gb = 2 * N * K / 1e9
    print(f"{N}x{K}: " + "  ".join(f"{n} {gb/min(v):.1f}" for n, v in res.items()), "GB/s", flush=True)
