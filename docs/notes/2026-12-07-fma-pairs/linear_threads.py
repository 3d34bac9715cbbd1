"""native.linear of 512 rows under batch invariance (the bf16 kernels at every count) at THREADS threads,
ms (best of 3 x 3): `OMP_WAIT_POLICY=PASSIVE PYTHONPATH=TREE python linear_threads.py THREADS`."""
import sys, time, torch, json
from hybridmoe import native
from hybridmoe.invariance import rows_alone
torch.set_num_threads(int(sys.argv[1]))
out = {}
with rows_alone():
    for O, I in [(4096, 2048), (2048, 4096), (576, 576), (1553, 576)]:
        w = (torch.randn(O, I) * 0.05).bfloat16(); x = torch.randn(512, I).bfloat16()
        best = []
        for _ in range(3):
            native.linear(x, w)
            t0 = time.perf_counter()
            for _ in range(3): native.linear(x, w)
            best.append((time.perf_counter() - t0) / 3 * 1e3)
        out[f"{O}x{I}"] = round(min(best), 2)
print(json.dumps(out))
