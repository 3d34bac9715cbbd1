"""The decode attention of one sequence (9/3 heads of 64, the demo's), one thread: the native build
against the emulated one."""
import time, statistics, torch
from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load
torch.set_num_threads(1)
libs = {n: load(k.SOURCE, k.flags(i), k.SIGNATURES, k.HEADERS) for n, i in (("native", k.NATIVE), ("emulated", k.EMULATED))}
H, KVH, D, L, BS = 9, 3, 64, 640, 16
for L in (128, 640, 2048):
    slots = (L // BS + 1) * BS
    kp = torch.randn(slots, KVH, D).bfloat16(); vp = torch.randn(slots, KVH, D).bfloat16()
    q = torch.randn(1, H, D).bfloat16(); out = torch.empty(1, H, D, dtype=torch.bfloat16)
    tables = torch.arange(slots // BS, dtype=torch.int32); starts = torch.zeros(1, dtype=torch.int32)
    lengths = torch.tensor([L], dtype=torch.int32); rows = torch.zeros(1, dtype=torch.int32)
    res = {}
    for rnd in range(3):
        for n, lib in libs.items():
            ts = []
            for _ in range(300):
                t = time.perf_counter()
                lib.hm_decode_attention_bf16(q.data_ptr(), q.stride(0), kp.data_ptr(), kp.stride(0), vp.data_ptr(), vp.stride(0), tables.data_ptr(), starts.data_ptr(), lengths.data_ptr(), rows.data_ptr(), 1, BS, H, KVH, D, D, 0.125, out.data_ptr(), out.stride(0), 1, 1)
                ts.append(time.perf_counter() - t)
            res.setdefault(n, []).append(statistics.median(ts))
    print(L, {n: f"{min(v)*1e6:.1f} us" for n, v in res.items()})
