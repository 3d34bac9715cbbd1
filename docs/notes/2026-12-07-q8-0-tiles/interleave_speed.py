"""Load-time interleaving, GB/s: d2f3dcc's hm_to_x8 (/tmp/prof/old.c) against this tree's hm_interleave."""
import ctypes, subprocess, time, torch, statistics
from hybridmoe.native import quant as qn
from hybridmoe.bench.products import _weights
libs = {}
for name, src, fn in (("old", "/tmp/prof/old.c", "hm_to_x8"), ("new", "hybridmoe/native/quant.c", "hm_interleave")):
    out = f"/tmp/prof/ilv_{name}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", src, "-o", out, "-lm"], check=True)
    f = getattr(ctypes.CDLL(out), fn); f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]; f.restype = ctypes.c_int
    libs[name] = f
for fmt, ggml in (("q4_k", 12), ("q6_k", 14), ("q8_0", 8)):
    w = _weights(torch.randn(4096, 2048) * 0.02, fmt).data
    res = {"old": [], "new": []}
    for r in range(7):
        for name, f in libs.items():
            d = w.clone()
            t = time.perf_counter(); rc = f(ggml, d.data_ptr(), 4096, 2048); dt = time.perf_counter() - t
            if rc == 0: res[name].append(d.numel() / dt / 1e9)
    print(fmt, {k: f"{statistics.median(v):.2f} GB/s" if v else "n/a" for k, v in res.items()})
