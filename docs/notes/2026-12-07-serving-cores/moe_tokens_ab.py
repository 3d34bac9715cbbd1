"""A decode step's 8 tokens through 30 layers of demo-shaped bf16 experts (576 x 48, top-8 of 16,
weights in 2 MB pages: from RAM), one thread, rows alone: native.moe_tokens a token a call against
one call for the 8 (each expert read once), and that both give the same bits."""
import time, torch
from hybridmoe import native
from hybridmoe.native import bf16 as nb
from hybridmoe.native.huge_pages import arena
from hybridmoe.invariance import rows_alone
torch.set_num_threads(1)
H, I, E, K, T, L = 576, 48, 16, 8, 8, 30
layers = []
for l in range(L):
    ws = [(arena().copy((torch.randn(2 * I, H) * 0.05).bfloat16()), arena().copy((torch.randn(H, I) * 0.05).bfloat16())) for _ in range(E)]
    table = torch.tensor([[g.data_ptr(), d.data_ptr()] for g, d in ws], dtype=torch.int64)
    layers.append((ws, table))
x = torch.randn(T, H).bfloat16()
ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).contiguous()
w = torch.softmax(torch.randn(T, K), -1).contiguous()
def per_token():
    return torch.cat([native.moe_tokens(tab, ids[t:t+1].contiguous(), w[t:t+1].contiguous(), x[t:t+1], I, 1) for _, tab in layers for t in range(T)][-T:])
def grouped():
    for _, tab in layers: y = native.moe_tokens(tab, ids, w, x, I, 1)
    return y
with rows_alone():
    a, b = per_token(), grouped()
    print("same bits:", torch.equal(a, b))
    for _ in range(3):
        for f in (per_token, grouped):
            t0 = time.perf_counter(); f(); print(f.__name__, f"{1000*(time.perf_counter()-t0)/L:.3f} ms a layer")
