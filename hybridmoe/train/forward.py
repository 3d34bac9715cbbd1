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

from hybridmoe.layers import lora
from hybridmoe.layers.lora import RowAdapters
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.tensor import linear as qlinear
from hybridmoe.quant.transposed import times


class Sequences:
    """The KVContext of a training pass (layers/attention.py): no cache, each sequence's history
    is its own entries of this pass."""

    whole_sequences = True  # every sequence is all here: layers/packed_attention.py applies

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
    return head_cross_entropy(hidden[batch.rows], model.head_weight, batch.targets)


# Rows of logits made at a time by head_cross_entropy: [CHUNK, V] fp32 (49152 columns: 25 MB),
# made at the end of the forward, when a step holds the most memory.
CHUNK = 128


def head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The summed cross-entropy of the LM head's fp32 logits hidden [N, H] @ weight^T [H, V] at
    `targets` [N], made CHUNK rows at a time. The head's weight is frozen, so the gradient of the
    loss is needed for `hidden` alone: it is computed along, [N, H], and the [N, V] logits and
    probabilities are never kept for the backward."""
    return _HeadCrossEntropy.apply(hidden, weight, targets)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        total = torch.zeros((), dtype=torch.float32)
        grad = torch.empty(hidden.shape, dtype=torch.float32)  # [N, H]
        for start in range(0, len(hidden), CHUNK):
            h, t = hidden[start : start + CHUNK], targets[start : start + CHUNK]
            logits = qlinear(h, weight).float()  # [c, V]
            picked = logits.gather(1, t[:, None])[:, 0]  # [c]
            top = logits.amax(dim=-1, keepdim=True)  # [c, 1]
            # exp(logits - top) in place: logsumexp would make a second [c, V] fp32 tensor
            sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)  # [c, 1]
            total += (top[:, 0] + sums[:, 0].log() - picked).sum()
            if not ctx.needs_input_grad[0]:  # held-out loss: no backward to come
                continue
            probs = logits.div_(sums)  # softmax, in place of the logits
            probs[torch.arange(len(t)), t] -= 1  # d(loss)/d(logits)
            grad[start : start + CHUNK] = _back(probs, weight, hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.dtype), None, None


def _back(g: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """g [c, V] @ weight [V, H] -> [c, H], in the weight's dtype or, for a head in blocks (GGUF),
    in `dtype`, the blocks dequantised a tile of rows at a time (quant/transposed.py), never
    whole."""
    if isinstance(weight, QTensor):
        return times(g.to(dtype), weight)
    return g.to(weight.dtype) @ weight
