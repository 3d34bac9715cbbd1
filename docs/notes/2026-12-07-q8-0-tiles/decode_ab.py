"""One-token / few-token product A/B over COUNT matrices read from RAM, two quant.c sources alternating.
Usage: decode_ab.py FMT N K M COUNT ROUNDS. SRC_A (default /tmp/prof/old.c: `git show d2f3dcc:hybridmoe/native/quant.c`)
on GGUF rows against SRC_B (default this tree's quant.c) on the interleaved layout; ISA=1: both on GGUF rows, AVX2 path;
BOTH=1: both on the interleaved layout (two sources that both know it). T: threads."""
import ctypes, subprocess, sys, time, torch, os, statistics
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.interleave import interleave
fmt = sys.argv[1]; N, K, M, count, rounds = map(int, sys.argv[2:7]); T = int(os.environ.get("T", "1"))
libs = []
for i, src in enumerate([os.environ.get("SRC_A", "/tmp/prof/old.c"), os.environ.get("SRC_B", "hybridmoe/native/quant.c")]):
    out = f"/tmp/prof/abd{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", src, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); f = lib.hm_qlinear; f.argtypes, f.restype = qn.SIGNATURES["hm_qlinear"]; libs.append(f)
from hybridmoe.bench.products import _weights
base = _weights(torch.randn(N, K) * 0.02, fmt).data
plain = [base.clone() for _ in range(count)]
lay = [interleave(p, fmt) for p in plain]
ids = [FORMATS[fmt].ggml, INTERLEAVED[fmt].ggml]
ISA = int(os.environ.get("ISA", "2"))
sets = [lay, lay] if os.environ.get("BOTH") else [plain, lay] if ISA == 2 else [plain, plain]
if ISA != 2: ids = [ids[0], ids[0]]
if os.environ.get("BOTH"): ids = [ids[1], ids[1]]
x = torch.randn(M, K).to(torch.bfloat16); y = torch.empty(M, N)
res = [[], []]
for r in range(rounds):
    for i in (0, 1):
        t0 = time.perf_counter()
        for w in sets[i]:
            libs[i](ids[i], w.data_ptr(), w.stride(0), N, K, x.data_ptr(), K, 1, M, y.data_ptr(), N, T, ISA)
        res[i].append(count * base.numel() / (time.perf_counter() - t0) / 1e9)
for name, r in zip(("old GGUF rows", "new rows in 16s"), res): print(f"{fmt} {N}x{K} M={M} T={T} isa={ISA} {name}: median {statistics.median(r):.2f} GB/s  max {max(r):.2f}")
