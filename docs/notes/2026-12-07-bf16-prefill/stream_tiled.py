"""One-row tile products from weights already in the tiled layout (16 rows x 32 columns a KB, the
group's KBs one after another), 2 MB pages, against the row kernel (GB/s, median of 5, one thread):
stream_tiled.c (tiles loaded straight from the weights; PF 0 none, 1 T0 1 KB ahead, 2 T0 2 KB + T1
8 KB, 3 T0 4 KB) and stream_tiled_ring.c (each KB copied by vector loads into a ring of RING KB,
tile-loaded LAG KB behind; PF0/PF1 the T0/T1 distances). Builds into /tmp."""
import ctypes
import os
import subprocess

import torch

from hybridmoe.native import bf16 as nb
from hybridmoe.native.huge_pages import arena
from one_row_rates import one_row_rates

here = os.path.dirname(os.path.abspath(__file__))
variants = {f"tiled pf{p}": ("stream_tiled.c", dict(PF=p)) for p in (0, 1, 2, 3)}
for ring, lag, pf0, pf1 in ((16, 4, 512, 0), (16, 4, 512, 4096), (8, 2, 512, 4096), (16, 8, 1024, 8192), (4, 1, 512, 4096)):
    variants[f"ring {ring} lag {lag} pf {pf0}/{pf1}"] = ("stream_tiled_ring.c", dict(RING=ring, LAG=lag, PF0=pf0, PF1=pf1))
libs = {}
for i, (name, (src, defs)) in enumerate(variants.items()):
    out = f"/tmp/stream_tiled_{i}.so"
    subprocess.run(["gcc", "-O3", "-march=native", *[f"-D{k}={v}" for k, v in defs.items()], "-shared", "-fPIC",
                    os.path.join(here, src), "-o", out], check=True)
    lib = ctypes.CDLL(out)
    lib.permit()
    lib.amx1.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    libs[name] = lib
torch.set_num_threads(1)
nat = nb.library()
for O, I in [(49152, 576), (4096, 2048), (1536, 2048)]:
    n = max(2, 300_000_000 // (2 * O * I))
    ws = [arena().copy((torch.randn(O, I) * 0.05).bfloat16()) for _ in range(n)]
    wt = [arena().copy(w.view(O // 16, 16, I // 32, 32).permute(0, 2, 1, 3).contiguous().view(O, I)) for w in ws]
    x, y = torch.randn(1, I).bfloat16(), torch.empty(1, O)
    err = [0.0]
    def check(y):
        err[0] = max(err[0], float((y - x.float() @ ws[-1].float().T).abs().max()))
    res = one_row_rates(nat, libs, ws, wt, x, y, 5, check)
    print(O, I, {k: round(sorted(v)[len(v) // 2], 2) for k, v in res.items()}, "largest error", err[0])
