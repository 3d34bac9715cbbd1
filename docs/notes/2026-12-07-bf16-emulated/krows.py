"""One-row bf16 products, one thread: the native build against the emulated one, weights from L2
(one copy) or rotating through RAM (128 MB of copies). `rates` is shared with nta.py."""
import statistics
import time

import torch

from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load


def rates(libs: dict, cases, reps: int = 300, rounds: int = 3) -> None:
    """Print GB/s of each library (name -> lib) on each (N, K, "L2" or "RAM"), best of `rounds`
    medians, the libraries alternated within each round."""
    for N, K, src in cases:
        n_copies = 1 if src == "L2" else max(2, (128 << 20) // (2 * N * K))
        ws = [torch.randn(N, K).bfloat16() for _ in range(n_copies)]
        x, y = torch.randn(1, K).bfloat16(), torch.empty(1, N)
        res = {}
        for _ in range(rounds):
            for name, lib in libs.items():
                ts = []
                for r in range(reps):
                    w = ws[r % len(ws)]
                    t = time.perf_counter()
                    lib.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), K, y.data_ptr(), N, N, K, 1)
                    ts.append(time.perf_counter() - t)
                res.setdefault(name, []).append(statistics.median(ts))
        gb = 2 * N * K / 1e9
        print(f"{N}x{K} {src}: " + "  ".join(f"{n} {gb / min(v):.1f} GB/s" for n, v in res.items()), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    libs = {n: load(k.SOURCE, k.flags(i), k.SIGNATURES, k.HEADERS) for n, i in (("native", k.NATIVE), ("emulated", k.EMULATED))}
    rates(libs, [(576, 576, "L2"), (4096, 576, "RAM"), (4096, 768, "RAM"), (2048, 1024, "RAM"), (1024, 2048, "RAM"),
                 (4096, 2048, "RAM"), (512, 4096, "RAM"), (256, 2048, "L2")])
