"""Alternating A/B of quant.c sources on one product (tiles on). Usage: abk.py A.c,B.c,... FMT N K M ROUNDS REPS"""
import ctypes, subprocess, sys, time, torch, os, statistics
from hybridmoe.native import quant as qn
from hybridmoe.quant.tensor import QTensor, for_kernels
srcs=sys.argv[1].split(","); fmt=sys.argv[2]; N,K,M,rounds,reps=map(int,sys.argv[3:8]); T=int(os.environ.get("T","1"))
qn._tiles_permitted()
fs=[]
for i,src in enumerate(srcs):
    out=f"/tmp/prof/abk{i}.so"
    subprocess.run(["cc", *qn.FLAGS, f"-I{qn.SOURCE.parent}", src, "-o", out, "-lm"], check=True)
    lib=ctypes.CDLL(out); lib.hm_set_amx8(int(os.environ.get("AMX8","1")))
    f=lib.hm_qlinear; f.argtypes,f.restype=qn.SIGNATURES["hm_qlinear"]; fs.append(f)
m=for_kernels(QTensor.quantize(torch.randn(N,K)*0.02,fmt))
x=torch.randn(M,K).to(torch.bfloat16); ys=[]
for f in fs:
    y=torch.empty(M,N); f(m.fmt.ggml,m.data.data_ptr(),m.data.stride(0),N,K,x.data_ptr(),K,1,M,y.data_ptr(),N,T,2); ys.append(y)
print("same bits:", all(torch.equal(ys[0],y) for y in ys))
res=[[] for _ in fs]
for r in range(rounds):
    for i,f in enumerate(fs):
        t0=time.perf_counter()
        for _ in range(reps): f(m.fmt.ggml,m.data.data_ptr(),m.data.stride(0),N,K,x.data_ptr(),K,1,M,y.data_ptr(),N,T,2)
        res[i].append((time.perf_counter()-t0)/reps*1e3)
for s,r in zip(srcs,res): print(f"{s}: median {statistics.median(r):.2f} ms  min {min(r):.2f}")
