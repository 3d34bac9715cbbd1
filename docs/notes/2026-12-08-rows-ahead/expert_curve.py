"""One CPU expert (calibrate's ColdExperts: each call on a copy the others pushed out of the caches) at
1..64 tokens: PYTHONPATH=. python expert_curve.py 1536x768 q6_k [threads]"""
import sys, torch
from hybridmoe.experts.run.calibrate import ColdExperts, time_cpu_expert
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
h, i = map(int, sys.argv[1].split("x")); fmt = sys.argv[2]
ex = ColdExperts(h, i, torch.bfloat16, fmt)
for n in (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64):
    t = min(time_cpu_expert(ex, n, 6) for _ in range(2))
    print(f"n={n:4d} {t*1e3:.4f} ms  {t*1e6/n:.2f} us/token")
