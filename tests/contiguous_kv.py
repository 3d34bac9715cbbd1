"""The simplest forward for tests: a contiguous KV cache per sequence and one model call per chunk.

An independent reference for the engine's paged cache: parity, GGUF and runtime tests drive the
model through it, so that a bug in paging or scheduling cannot hide a bug in a model (or the
reverse)."""

from __future__ import annotations

import torch


class SequenceKV:
    """One sequence's cache: for each layer,
    a tuple of tensors [capacity, ...] and a fill length."""

    def __init__(self):
        self.layers: dict[int, list[torch.Tensor]] = {}
        self.lengths: dict[int, int] = {}

    def append(self, layer: int, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        n = entries[0].shape[0]
        used = self.lengths.get(layer, 0)
        bufs = self.layers.get(layer)
        if bufs is None or used + n > bufs[0].shape[0]:
            capacity = max(64, 2 * (used + n))  # doubling keeps appends amortised O(1)
            new = [torch.empty((capacity, *e.shape[1:]), dtype=e.dtype) for e in entries]
            if bufs is not None:
                for dst, src in zip(new, bufs):
                    dst[:used] = src[:used]
            self.layers[layer] = bufs = new
        for buf, e in zip(bufs, entries):
            buf[used : used + n] = e
        self.lengths[layer] = used + n
        return tuple(buf[: used + n] for buf in bufs)

    def truncate(self, length: int) -> None:
        for layer in self.lengths:
            self.lengths[layer] = min(self.lengths[layer], length)


class BatchKVContext:
    """The KVContext of one step over several sequences with contiguous caches."""

    def __init__(self, caches: list[SequenceKV], seq_lens: list[int]):
        self.caches, self.seq_lens = caches, seq_lens

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        out, start = [], 0
        for cache, n in zip(self.caches, self.seq_lens):
            out.append(cache.append(layer, tuple(e[start : start + n] for e in entries)))
            start += n
        return out


@torch.inference_mode()
def forward_step(
    model, cache: SequenceKV, ids: list[int], start: int, decode: bool = False
) -> torch.Tensor:
    """Run `ids` at positions start.. through the model; fp32 logits of the last position [V].
    `decode`: the step is one decode token (the engine says so to the expert runtime)."""
    input_ids = torch.tensor(ids, dtype=torch.long)
    positions = torch.arange(start, start + len(ids))
    rows = [(len(ids) - 1, "seq")] if decode else []
    hidden = model(input_ids, positions, BatchKVContext([cache], [len(ids)]), rows)  # [n, H]
    return model.logits(hidden[-1:])[0]
