"""A/B of quant.c variants on Q6_K, one process, alternating: the old library reads GGUF rows, the
new one rows in eights (as each loads them). Usage: ab6.py OLD.c NEW.c N K THREADS MATS PASSES M"""
import ctypes, statistics, subprocess, sys, time, torch, os
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor, for_kernels
old, new = sys.argv[1], sys.argv[2]
N, K, T, nm, passes, M = map(int, sys.argv[3:9])
ISA = int(os.environ.get("ISA", "2"))
libs = []
for i, s in enumerate((old, new)):
    out = f"/tmp/prof/v6{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", s, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    try: lib.hm_set_amx8(int(os.environ.get("AMX8", "1")))
    except AttributeError: pass
    f = lib.hm_qlinear; f.argtypes, f.restype = qn.SIGNATURES["hm_qlinear"]; libs.append(f)
torch.manual_seed(0)
dense = [torch.randn(N, K) * 0.02 for _ in range(min(nm, 4))]
plain = [QTensor.quantize(dense[i % len(dense)], "q6_k") for i in range(nm)]
eights = [for_kernels(QTensor(QTensor.quantize(dense[i % len(dense)], "q6_k").data.clone(), plain[0].fmt, K)) for i in range(nm)]
print("layouts:", plain[0].fmt.name, eights[0].fmt.name)
x = torch.randn(M, K).to(torch.bfloat16)
sets = (plain, eights)
def run(f, m, y):
    f(m.fmt.ggml, m.data.data_ptr(), m.data.stride(0), N, K, x.data_ptr(), K, 1, M, y.data_ptr(), N, T, ISA)
ys = []
for f, mats in zip(libs, sets):
    y = torch.empty(M, N); run(f, mats[0], y); ys.append(y)
ref = x.double() @ plain[0].dequantize().double().T
for s, y in zip(("old", "new"), ys):
    print(s, "max rel err vs f64:", ((y.double() - ref).abs().max() / ref.abs().max()).item(), "diff vs old:", (y - ys[0]).abs().max().item())
res = [[], []]
y = torch.empty(M, N)
for _ in range(passes):
    for i, (f, mats) in enumerate(zip(libs, sets)):
        t0 = time.perf_counter_ns()
        for m in mats: run(f, m, y)
        res[i].append((time.perf_counter_ns() - t0) / len(mats) / 1e3)
nb = plain[0].data.numel()
for s, r in zip(("old", "new"), res):
    med = statistics.median(r)
    print(f"{s}: {med:.1f} us/matrix, {nb / med / 1e3:.2f} GB/s ({M} tokens)")
