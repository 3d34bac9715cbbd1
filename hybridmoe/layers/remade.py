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


class _Part(Remade):
    """Item i of what a shared Remade makes (a tuple)."""

    def __init__(self, whole: Remade, i: int):
        self.whole, self.i = whole, i

    def get(self) -> torch.Tensor:
        return self.whole.get()[self.i]


def parts(
    tensors: tuple[torch.Tensor, ...], make: Callable[[], tuple[torch.Tensor, ...]]
) -> Callable[[torch.Tensor], Remade | None]:
    """A saved_as pick that keeps each of `tensors` as its place in make()'s tuple, made once for
    all of them; other saved tensors are kept."""
    whole = Remade(make)
    places = {_layout(t): i for i, t in enumerate(tensors)}

    def pick(t: torch.Tensor) -> Remade | None:
        i = places.get(_layout(t))
        return None if i is None else _Part(whole, i)

    return pick


def _layout(t: torch.Tensor) -> tuple:
    """What tells a tensor from other saved tensors: memory, shape, layout."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)
