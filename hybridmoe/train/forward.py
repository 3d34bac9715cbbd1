"""A training pass: whole sequences through the model without a KV cache, and the loss.

A batch is several sequences packed one after another into the model's flat [T] inputs, as the
engine packs a step: no padding, positions restarting at 0 for each, and each sequence attending
only to itself (`Sequences` hands every attention layer the sequence's own keys and values). The
loss is taken only where a token is marked to be learned (the assistant's turns of a chat), and
only those rows go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.layers import lora
from hybridmoe.layers.lora import RowAdapters


class Sequences:
    """The KVContext of a training pass (layers/attention.py): no cache, each sequence's history
    is its own entries of this pass."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = list(seq_lens)

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        out, start = [], 0
        for n in self.seq_lens:
            out.append(tuple(e[start : start + n] for e in entries))
            start += n
        return out


@dataclass
class Batch:
    """Packed sequences and what they teach: row `rows[i]` predicts token `targets[i]`."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_lens: list[int]
    rows: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]

    @staticmethod
    def of(examples: list[tuple[list[int], list[bool]]]) -> Batch:
        """From (token ids, learn mask) pairs: token j+1 is a target where its mask is set."""
        ids, positions, lens, rows, targets = [], [], [], [], []
        for tokens, learn in examples:
            start = len(ids)
            ids += tokens
            positions += range(len(tokens))
            lens.append(len(tokens))
            for j in range(1, len(tokens)):
                if learn[j]:
                    rows.append(start + j - 1)
                    targets.append(tokens[j])
        as_long = dict(dtype=torch.long)
        return Batch(
            torch.tensor(ids, **as_long),
            torch.tensor(positions, **as_long),
            lens,
            torch.tensor(rows, **as_long),
            torch.tensor(targets, **as_long),
        )

    @property
    def num_targets(self) -> int:
        return len(self.targets)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def loss_sum(model, batch: Batch, adapter: str | None) -> torch.Tensor:
    """The summed cross-entropy (fp32 scalar) of the batch's targets, the model running with
    adapter `adapter` on every row (None: the base model)."""
    rows = RowAdapters.all(adapter, batch.num_tokens) if adapter else None
    with lora.using(rows):
        hidden = model(batch.ids, batch.positions, Sequences(batch.seq_lens))  # [T, H]
        logits = model.logits(hidden[batch.rows])  # [N, V] fp32
    return F.cross_entropy(logits, batch.targets, reduction="sum")
