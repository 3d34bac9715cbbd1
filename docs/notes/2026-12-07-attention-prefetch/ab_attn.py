"""A/B of bf16.c variants' decode attention: one sequence, L positions, 32/4 heads of 128, blocks of
16 scattered, cold (a 48 MB read between calls, as a layer's weight stream) or warm.
PYTHONPATH=. python ab_attn.py A.c,B.c L [cold|warm] [threads]
(Settings added later: ISA, the build of native/bf16.py each variant is made for (NATIVE, the
default, EMULATED or AVX2; headers from the variant's folder first, then native/); ITERS, the rounds
alternating (default 40); H, KVH, D, the heads.)"""
import os, ctypes, statistics, subprocess, sys, time, torch
from hybridmoe.native import bf16 as B, huge_pages
def hp(t):
    o = huge_pages.zeros(tuple(t.shape), t.dtype); o.copy_(t); return o
srcs = sys.argv[1].split(","); L = int(sys.argv[2]); mode = sys.argv[3] if len(sys.argv) > 3 else "cold"
T = int(sys.argv[4]) if len(sys.argv) > 4 else 1
fs = []
for i, s in enumerate(srcs):
    out = f"/tmp/prof/a{i}.so"
    flags = B.flags(getattr(B, os.environ.get("ISA", "NATIVE")))
    heads = [f"-I{os.path.dirname(os.path.abspath(s))}", f"-I{B.SOURCE.parent}"]
    subprocess.run(["cc", *flags, *heads, s, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); f = lib.hm_decode_attention_bf16
    f.argtypes, f.restype = B.SIGNATURES["hm_decode_attention_bf16"]; fs.append(f)
torch.manual_seed(0); torch.set_num_threads(1)
import os; h, kvh, d, bs = int(os.environ.get("H", 32)), int(os.environ.get("KVH", 4)), int(os.environ.get("D", 128)), 16
nb = (L + bs - 1) // bs + 8
layers = []
for _ in range(4):
    k = hp(torch.randn(nb * 4 * bs, kvh, d).to(torch.bfloat16)); v = hp(torch.randn(nb * 4 * bs, kvh, d).to(torch.bfloat16))
    table = torch.randperm(nb * 4)[:nb].to(torch.int32)
    q = torch.randn(1, h, d).to(torch.bfloat16)
    layers.append((q, k, v, table))
flush = hp(torch.ones(12 << 20))  # 48 MB
outs = [torch.empty(1, h, d) for _ in fs]
st = torch.zeros(1, dtype=torch.int32); ln = torch.tensor([L], dtype=torch.int32); rows = torch.zeros(1, dtype=torch.int32)
res = [[] for _ in fs]
for it in range(int(os.environ.get("ITERS", 40))):
    for i, f in enumerate(fs):
        tot = 0
        for (q, k, v, table) in layers:
            if mode == "cold": flush.sum()
            t0 = time.perf_counter_ns()
            f(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), table.data_ptr(),
              st.data_ptr(), ln.data_ptr(), rows.data_ptr(), 1, bs, h, kvh, d, d, d ** -0.5, outs[i].data_ptr(),
              outs[i].stride(0), 0, T)
            tot += time.perf_counter_ns() - t0
        res[i].append(tot / 4 / 1e3)
for s, r, o in zip(srcs, res, outs):
    print(f"{s}: {statistics.median(r):.1f} us a layer ({1e3*statistics.median(r)/L:.0f} ns/position), max diff vs first {float((o-outs[0]).abs().max()):.2e}")
