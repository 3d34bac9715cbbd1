"""Tensors a backward needs, kept as the way to make them again rather than as themselves: a
training step's memory goes to what cannot be made cheaply (layers/norm.py, layers/mlp.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class Remade:
    """A saved tensor held as `make`, run when the backward first asks for it (gradients off),
    once."""

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make, self.t = make, None

    def get(self) -> torch.Tensor:
        if self.t is None:
            with torch.no_grad():
                self.t = self.make()
        return self.t


@contextmanager
def saved_as(pick: Callable[[torch.Tensor], Remade | None]) -> Iterator[None]:
    """Within: each tensor autograd saves is kept as pick(t) where that gives a Remade, else as
    it is."""

    def pack(t: torch.Tensor):
        remade = pick(t)
        return t if remade is None else remade

    def unpack(p):
        return p.get() if isinstance(p, Remade) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
