"""Activations made again in the backward instead of kept: a training step's attention blocks and
dense MLPs.

A block's intermediate tensors (q/k/v, the attention's inputs and output, a dense MLP's gate and
up) are most of what a training step would otherwise keep from its forward until its backward, for
every layer at once. Wrapped in `recompute`, a block keeps only its input; the backward runs it
again, one block at a time (torch.utils.checkpoint, non-reentrant, with the RNG state, so dropout
draws the same masks). The routed experts are not wrapped: their backward
(experts/run/expert_grad.py) keeps a few small tensors and runs on the expert runtime, which counts
each layer once per step. Shared experts and norms keep what their backward needs instead
(layers/mlp.py, layers/norm.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from hybridmoe.layers import lora


def recompute(training: bool, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args); in a training step (`training`, the module's mode, and gradients being recorded)
    its activations are dropped after the forward and made again in the backward, under the same
    row adapters (layers/lora.py: the thread's adapters of this pass, gone by the time the backward
    runs). Never otherwise: a pass over a KV cache must append to it once."""
    if not (training and torch.is_grad_enabled()):
        return fn(*args)
    rows = lora.current()

    def again(*a):
        with lora.using(rows):
            return fn(*a)

    return checkpoint(again, *args, use_reentrant=False)
