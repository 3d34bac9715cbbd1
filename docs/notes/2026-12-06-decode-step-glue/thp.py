"""Interleaved A/B: the Q4_K x8 one-token product over matrices in 4 KB pages (torch's allocation)
against the same bytes in 2 MB pages (an anonymous map with MADV_HUGEPAGE), alternating passes.
Usage: PYTHONPATH=. python thp.py FORMAT N K THREADS MATRICES (e.g. q4_k 4096 2048 1 100)."""
import mmap, statistics, sys, time, torch
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor, for_kernels
fmt_name, N, K, T, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
f = qn.library().hm_qlinear
torch.manual_seed(0)
base = for_kernels(QTensor.quantize(torch.randn(N, K) * 0.02, fmt_name))
rb = base.data.stride(0); nbytes = base.data.numel()
small = [base.data.clone() for _ in range(n)]
for s in small: s.add_(0)
buf = mmap.mmap(-1, nbytes * n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf.madvise(mmap.MADV_HUGEPAGE)
big = torch.frombuffer(buf, dtype=torch.uint8)
big.zero_()
huge = []
for i in range(n):
    t = big[i * nbytes:(i + 1) * nbytes].view(N, rb); t.copy_(base.data); huge.append(t)
print(open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split('\n')[0].strip(), "anon huge")
x = torch.randn(1, K).to(torch.bfloat16); y = torch.empty(1, N)
res = {"4k": [], "2m": []}
for _ in range(15):
    for name, mats in (("4k", small), ("2m", huge)):
        t0 = time.perf_counter_ns()
        for m in mats:
            f(base.fmt.ggml, m.data_ptr(), rb, N, K, x.data_ptr(), K, 1, 1, y.data_ptr(), N, T, qn.isa())
        res[name].append((time.perf_counter_ns() - t0) / n / 1e3)
for name, r in res.items():
    med = statistics.median(r); print(f"{name}: {med:.1f} us/matrix, {nbytes / med / 1e3:.2f} GB/s")
