"""A plain read of 576 scattered 1 KB rows of K and V (blocks of 16), after a 48 MB read, their rows
asked for in bursts of 16 or a row at a time (rd.c).
Build: cc -O3 -mavx512f -shared -fPIC rd.c -o /tmp/prof/rd.so; then PYTHONPATH=. python rd.py"""

import ctypes
import statistics
import time

import torch

from hybridmoe.native import huge_pages

torch.set_num_threads(1)
lib = ctypes.CDLL("/tmp/prof/rd.so")
f = lib.rd
f.restype = ctypes.c_double
f.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
f.argtypes += [ctypes.c_int] * 4


def hp(t):
    o = huge_pages.zeros(tuple(t.shape), t.dtype)
    o.copy_(t)
    return o


L, bs = 576, 16
nb = L // bs + 8
k, v = hp(torch.randn(nb * 4 * bs, 256)), hp(torch.randn(nb * 4 * bs, 256))  # rows of 1 KB
table = torch.randperm(nb * 4)[:nb]
slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(L)], dtype=torch.long)
flush = hp(torch.ones(12 << 20))
for burst, settings in ((1, [(0, 0), (16, 0), (32, 0), (16, 1), (32, 1), (16, 2)]),
                        (0, [(4, 0), (8, 0), (16, 0), (8, 1), (16, 1), (8, 2)])):  # fmt: skip
    for work in (0, 25, 100):
        for ahead, hint in settings:
            ts = []
            for _ in range(30):
                flush.sum()
                t0 = time.perf_counter_ns()
                f(k.data_ptr(), v.data_ptr(), 1024, slots.data_ptr(), L, 1024, ahead, hint, work, burst)
                ts.append(time.perf_counter_ns() - t0)
            m = statistics.median(ts) / 1e3
            kind = "burst" if burst else "a row at a time"
            print(f"work {work} {kind} ahead {ahead} hint {hint}: {m:.1f} us, {2 * L * 1024 / m / 1e3:.1f} GB/s")
