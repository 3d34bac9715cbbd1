"""A module's weight read without nn.Module's __getattr__, for the checks a decode step runs on
every layer: an attribute that is neither in the instance's dict nor its class (parameters,
submodules) goes through that Python function, ~0.7 us a read warm and several times that on the
caches a layer's weight stream has emptied; a dict read is a few tens of ns. Submodules are read
from `module._modules[name]` directly."""

from __future__ import annotations

from torch import nn


def held(module: nn.Module, name: str):
    """module.<name>: a value set in a parameter's place (a QTensor, models/base.py) is a plain
    attribute; a parameter (or None, a bias that is not there) is in `_parameters`."""
    value = module.__dict__.get(name)
    return module._parameters.get(name) if value is None else value
