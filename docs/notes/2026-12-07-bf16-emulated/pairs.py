"""bf16.c's products on this CPU: native build with the fma pairs on and off (vdpbf16ps), and the
emulated build (AVX512F only), one thread. Weights rotate through 8 copies (>L3) for few rows."""
import time, statistics, sys
import torch
from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load
torch.set_num_threads(1)
nat = load(k.SOURCE, k.flags(k.NATIVE), k.SIGNATURES, k.HEADERS)
emu = load(k.SOURCE, k.flags(k.EMULATED), k.SIGNATURES, k.HEADERS)
nat.hm_fma_pairs_check(); emu.hm_fma_pairs_check()
def run(lib, pairs, M, N, K, copies, reps):
    lib.hm_set_fma_pairs(pairs)
    ws = [torch.randn(N, K).bfloat16() for _ in range(copies)]
    x = torch.randn(M, K).bfloat16(); y = torch.empty(M, N)
    ts = []
    for r in range(reps):
        w = ws[r % copies]
        t = time.perf_counter(); lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), K, y.data_ptr(), N, N, K, M); ts.append(time.perf_counter() - t)
    return statistics.median(ts[copies:])
cases = [(1, 4096, 2048, 8, 40), (4, 4096, 2048, 8, 40), (8, 4096, 2048, 8, 40), (512, 576, 576, 1, 15), (512, 2048, 768, 1, 8)]
for M, N, K, c, reps in cases:
    out = []
    for rnd in range(2):
        for name, lib, p in [("native pairs", nat, 1), ("native vdpbf16ps", nat, 0), ("emulated", emu, 1)]:
            out.append((name, run(lib, p, M, N, K, c, reps)))
    res = {}
    for n, t in out: res.setdefault(n, []).append(t)
    gb = 2 * N * K / 1e9
    print(f"{M}x{N}x{K}: " + "  ".join(f"{n} {min(v)*1e3:.3f} ms ({gb/min(v):.1f} GB/s, {2*M*N*K/min(v)/1e9:.0f} GF/s)" for n, v in res.items()), flush=True)
