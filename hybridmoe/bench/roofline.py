"""The decode roofline of a GGUF model on this machine: the bytes of weights one decoded token
reads (every dense matrix whole, one row of the embedding, top_k of each layer's routed experts)
over the read bandwidth measured here: the best of several passes of row sums over a buffer far
larger than the caches (rows split across the threads; the best pass, because on a shared
machine a pass can only lose time to other processes: docs/notes/2026-11-24-gguf-files.md), in
2 MB pages where the system gives them, as the weights are (native/huge_pages.py): this machine's
core read 13.4 GB/s from 4 KB pages and 14.9 from 2 MB ones
(docs/notes/2026-12-06-decode-step-glue.md)."""

from __future__ import annotations

import time

import torch

from hybridmoe.native import huge_pages

BUFFER_BYTES = 1 << 30  # 1 GiB: ~30x this machine's L3


def bytes_per_token(path: str) -> int:
    """Bytes of weights a decoded token reads from the GGUF file `path`."""
    from hybridmoe.loader import gguf_file

    reader = gguf_file.Reader(path)
    meta = gguf_file.metadata(path)
    arch = meta["general.architecture"]
    top_k, experts = meta.get(f"{arch}.expert_used_count", 1), meta.get(f"{arch}.expert_count", 1)
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        if t.name.endswith("_exps.weight"):
            n = n * top_k // experts
        elif t.name == "token_embd.weight":
            n //= int(t.shape[-1])  # one row: the token's embedding
        total += n
    return total


def read_bandwidth(threads: int, repeats: int = 15) -> float:
    """Bytes per second that `threads` threads read: the best of `repeats` passes over 1 GiB (the
    peak, which decode can at best approach; other processes on the machine only lower a pass)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = huge_pages.zeros((4096, BUFFER_BYTES // 4 // 4096), torch.float32)  # [4096, 64K]
        buf.fill_(1.0)  # every page touched
        buf.sum(1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum(1)  # [4096]
            times.append(time.perf_counter() - t0)
        return BUFFER_BYTES / min(times)
    finally:
        torch.set_num_threads(before)
