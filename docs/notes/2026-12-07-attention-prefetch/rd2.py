"""A plain read of 576 scattered 1 KB rows of K and V (blocks of 16), after a 48 MB read, asked for in bursts of 16 rows (rd2.c).
Build: cc -O3 -mavx512f -shared -fPIC rd2.c -o /tmp/prof/rd2.so; then PYTHONPATH=. python rd2.py"""
import ctypes, time, statistics, torch
from hybridmoe.native import huge_pages
torch.set_num_threads(1)
lib = ctypes.CDLL("/tmp/prof/rd2.so"); f = lib.rd2; f.restype = ctypes.c_double
f.argtypes = [ctypes.c_void_p]*2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int]
def hp(t):
    o = huge_pages.zeros(tuple(t.shape), t.dtype); o.copy_(t); return o
L = 576; bs = 16; nb = L // bs + 8
k = hp(torch.randn(nb*4*bs, 256)); v = hp(torch.randn(nb*4*bs, 256))
table = torch.randperm(nb*4)[:nb]
slots = torch.tensor([int(table[l // bs]) * bs + l % bs for l in range(L)], dtype=torch.long)
flush = hp(torch.ones(12 << 20))
for work in [0, 100]:
  for ahead, hint in [(0,0),(16,0),(32,0),(16,1),(32,1),(16,2)]:
    ts = []
    for _ in range(30):
        flush.sum(); t0 = time.perf_counter_ns(); f(k.data_ptr(), v.data_ptr(), 1024, slots.data_ptr(), L, 1024, ahead, hint, work); ts.append(time.perf_counter_ns() - t0)
    m = statistics.median(ts) / 1e3
    print(f"work {work} burst ahead {ahead} hint {hint}: {m:.1f} us, {2*L*1024/m/1e3:.1f} GB/s")
