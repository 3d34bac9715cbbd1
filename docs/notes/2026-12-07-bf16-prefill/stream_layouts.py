"""One-row tile products streaming the head's shape from 2 MB pages, against the row kernel (GB/s, best
of 3): stream_ring.c (MODE 0 loads only, 1 plus a tdp a KB, 2 loads stored to a 16 KB ring and each KB
of it tile-loaded 4 KB behind, a tdp a KB: throughput only, not the product) and stream_staged.c (the
real product: each 16-row group copied in address order into a staging slot while the group before is
multiplied; TILED 0 keeps W's layout, 1 stores the lines in tile order). Builds into /tmp."""
import ctypes
import os
import subprocess

import torch

from hybridmoe.native import bf16 as nb
from hybridmoe.native.huge_pages import arena
from one_row_rates import one_row_rates

here = os.path.dirname(os.path.abspath(__file__))
libs = {}
for src, macro, values in (("stream_ring.c", "MODE", (0, 1, 2)), ("stream_staged.c", "TILED", (0, 1))):
    for v in values:
        out = f"/tmp/{src[:-2]}_{v}.so"
        cmd = ["gcc", "-O3", "-march=native", f"-D{macro}={v}", "-shared", "-fPIC"]
        subprocess.run([*cmd, os.path.join(here, src), "-o", out], check=True)
        lib = ctypes.CDLL(out)
        lib.permit()
        lib.amx1.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
        libs[f"{src[:-2]} {macro}={v}"] = lib
torch.set_num_threads(1)
nat = nb.library()
O, I, n = 49152, 576, 6
ws = [arena().copy((torch.randn(O, I) * 0.05).bfloat16()) for _ in range(n)]
x, y = torch.randn(1, I).bfloat16(), torch.empty(1, O)
res = one_row_rates(nat, libs, ws, ws, x, y, 3)
print({k: round(max(v), 2) for k, v in res.items()})
