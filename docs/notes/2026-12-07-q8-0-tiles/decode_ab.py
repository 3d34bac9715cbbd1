"""Decode (M tokens) A/B: old quant.c on GGUF rows vs new quant.c on rows in sixteens, over a set of matrices from RAM."""
import ctypes, subprocess, sys, time, torch, os, statistics
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.interleave import interleave
fmt = sys.argv[1]; N, K, M, count, rounds = map(int, sys.argv[2:7]); T = int(os.environ.get("T", "1"))
libs = []
for i, src in enumerate(["/tmp/prof/old.c", "hybridmoe/native/quant.c"]):
    out = f"/tmp/prof/abd{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", src, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); f = lib.hm_qlinear; f.argtypes, f.restype = qn.SIGNATURES["hm_qlinear"]; libs.append(f)
base = QTensor.quantize(torch.randn(N, K) * 0.02, fmt).data
plain = [base.clone() for _ in range(count)]
lay = [interleave(p, fmt) for p in plain]
ids = [FORMATS[fmt].ggml, INTERLEAVED[fmt].ggml]
ISA = int(os.environ.get("ISA", "2"))
sets = [plain, lay] if ISA == 2 else [plain, plain]
if ISA != 2: ids = [ids[0], ids[0]]
x = torch.randn(M, K).to(torch.bfloat16); y = torch.empty(M, N)
res = [[], []]
for r in range(rounds):
    for i in (0, 1):
        t0 = time.perf_counter()
        for w in sets[i]:
            libs[i](ids[i], w.data_ptr(), w.stride(0), N, K, x.data_ptr(), K, 1, M, y.data_ptr(), N, T, ISA)
        res[i].append(count * base.numel() / (time.perf_counter() - t0) / 1e9)
for name, r in zip(("old GGUF rows", "new rows in 16s"), res): print(f"{fmt} {N}x{K} M={M} T={T} isa={ISA} {name}: median {statistics.median(r):.2f} GB/s  max {max(r):.2f}")
