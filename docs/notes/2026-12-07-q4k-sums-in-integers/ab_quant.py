"""A/B of quant.c variants, one process, alternating. Usage: ab.py A.c,B.c FMT N K THREADS MATS PASSES"""
import ctypes, statistics, subprocess, sys, time, torch
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor, for_kernels
srcs = sys.argv[1].split(","); fmt_name = sys.argv[2]; N, K = int(sys.argv[3]), int(sys.argv[4])
import os; ISA = int(os.environ.get("ISA", "2"))
T = int(sys.argv[5]); nm = int(sys.argv[6]); passes = int(sys.argv[7]); M = int(sys.argv[8]) if len(sys.argv) > 8 else 1
libs = []
for i, s in enumerate(srcs):
    out = f"/tmp/prof/v{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", s, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); f = lib.hm_qlinear; f.argtypes, f.restype = qn.SIGNATURES["hm_qlinear"]; libs.append(f)
torch.manual_seed(0)
dense = [torch.randn(N, K) * 0.02 for _ in range(min(nm, 4))]
mats = [for_kernels(QTensor.quantize(dense[i % len(dense)], fmt_name)) for i in range(nm)]
x = torch.randn(M, K).to(torch.bfloat16)
ys = []
for f in libs:
    y = torch.empty(M, N); m = mats[0]
    f(m.fmt.ggml, m.data.data_ptr(), m.data.stride(0), N, K, x.data_ptr(), K, 1, M, y.data_ptr(), N, T, ISA); ys.append(y)
ref = x.double() @ mats[0].dequantize().double().T
for s, y in zip(srcs, ys):
    print(s, "max rel err vs f64:", ((y.double() - ref).abs().max() / ref.abs().max()).item(), "diff vs first:", (y - ys[0]).abs().max().item())
res = [[] for _ in libs]
for _ in range(passes):
    for i, f in enumerate(libs):
        t0 = time.perf_counter_ns()
        for m in mats:
            f(m.fmt.ggml, m.data.data_ptr(), m.data.stride(0), N, K, x.data_ptr(), K, 1, M, y.data_ptr(), N, T, ISA)
        res[i].append((time.perf_counter_ns() - t0) / len(mats) / 1e3)
nb = mats[0].data.numel()
for s, r in zip(srcs, res):
    med = statistics.median(r)
    print(f"{s}: {med:.1f} us/matrix, {nb / med / 1e3:.2f} GB/s")
