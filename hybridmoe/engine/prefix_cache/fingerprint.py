"""A model's identity for block keys: its config and a sample of every weight."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch

from hybridmoe.engine.prefix_cache.identity import KEY_BYTES

# Values sampled from each weight tensor: enough that two models of one architecture and shape
# (another seed, another fine-tune) differ, and cheap for any model size.
_SAMPLES = 64


def _weights(model) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
    store = getattr(getattr(model, "runtime", None), "store", None)
    for key, record in sorted(getattr(store, "records", {}).items()):
        for name, value in sorted(vars(record).items()):  # ExpertWeights: gate_up, down
            if isinstance(value, torch.Tensor):
                yield f"expert{key}.{name}", value


def model_fingerprint(model) -> bytes:
    """A hash of the model's config and of a strided sample of every weight tensor (routed experts
    included), with names, shapes and dtypes."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(json.dumps(model.cfg.data, sort_keys=True, default=str).encode())
    for name, t in _weights(model):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES)
        sample = flat[::step][:_SAMPLES].to(torch.float64)  # [<= 64]
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(sample.cpu().numpy().tobytes())
    return h.digest()
