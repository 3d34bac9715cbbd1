# One-row (or M-row) products from RAM on the three builds of bf16.c. Usage: python gemv.py O I [M]
import sys, time, torch
from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load
libs = {n: load(k.SOURCE, k.flags(i), k.SIGNATURES, k.HEADERS) for n, i in (("native", k.NATIVE), ("emul", k.EMULATED), ("avx2", k.AVX2))}
for lib in libs.values(): lib.hm_fma_pairs_check(); lib.hm_set_fma_pairs(0)
O, I = int(sys.argv[1]), int(sys.argv[2]); M = int(sys.argv[3]) if len(sys.argv) > 3 else 1
n = max(2, (256 << 20) // (O * I * 2))
ws = [torch.randn(O, I).bfloat16() for _ in range(n)]
x = torch.randn(M, I).bfloat16(); y = torch.empty(M, O)
for rnd in range(2):
    for name, lib in libs.items():
        ts = []
        for rep in range(3):
            t = time.perf_counter()
            for w in ws: lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), I, y.data_ptr(), O, O, I, M)
            ts.append(time.perf_counter() - t)
        t = min(ts); print(name, f"{n*O*I*2/t/1e9:.1f} GB/s", end="  ")
    print()
