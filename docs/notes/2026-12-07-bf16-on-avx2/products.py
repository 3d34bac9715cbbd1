# Many-row bf16 products, one thread: oneDNN bf16 (F.linear), the bf16 kernels (native.linear), fp32 F.linear.
# Usage: python products.py THREADS  (with the caps of avx2.sh, or of the Cascade Lake stand-in)
import time, torch, sys
import torch.nn.functional as F
from hybridmoe import native
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def t(f, n=5):
    f(); ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return sorted(ts)[n//2]*1e3
for (M,N,K) in [(512,576,576),(512,1536,576),(512,576,1536),(512,49152//1,576)]:
    if N == 49152: continue
    x=torch.randn(M,K).bfloat16(); w=torch.randn(N,K).bfloat16()
    xf, wf = x.float(), w.float()
    print(M,N,K, "oneDNN bf16 %.2f ms" % t(lambda: F.linear(x,w)), "kernels %.2f ms" % t(lambda: native.linear(x,w,None)), "fp32 %.2f ms" % t(lambda: F.linear(xf,wf)))
