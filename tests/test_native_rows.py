"""native/rows.py (RMSNorm and the rotary embedding in one call each) against the torch code of
layers/norm.py and layers/rotary.py, which they replace for bf16 rows outside training."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.layers import norm as norm_module
from hybridmoe.layers import rotary as rotary_module
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import apply_rotary
from hybridmoe.native import rows

needs_library = pytest.mark.skipif(rows.library() is None, reason="needs a C compiler")


@pytest.fixture
def torch_only(monkeypatch):
    """Runs fn with the native row ops off, as HYBRIDMOE_NATIVE=0 leaves them."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(rows, "library", lambda: None)
            return fn(*args)

    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _cos_sin(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))  # [dim/2]
    freqs = positions.float()[:, None] * inv  # [T, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, dim]
    return emb.cos(), emb.sin()


@needs_library
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("heads_step", [1, 2])  # 2: every other head, a strided view
def test_rotary_is_torchs_bit_for_bit(tokens, heads_step, torch_only):
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, 8, 64, generator=gen) * 4).to(torch.bfloat16)[:, ::heads_step]
    cos, sin = _cos_sin(torch.arange(tokens) + 1000, 64)
    with torch.inference_mode():
        got = apply_rotary(x, cos, sin)
        ref = torch_only(apply_rotary, x, cos, sin)
        assert rows.rotary_applies(x, cos) and not rows.rotary_applies(x.float(), cos)
    assert got.shape == ref.shape and torch.equal(_bits(got), _bits(ref))


@needs_library
@pytest.mark.parametrize("shape", [(1, 576), (5, 130), (2, 4, 128)])
def test_rmsnorm_matches_torch_to_the_last_bit_but_its_sums(shape, torch_only):
    """The mean of squares is summed in an order of rows.c's own: a row may differ from torch's
    by one bf16 unit where the scaled value lies on a rounding boundary, nowhere more."""
    gen = torch.Generator().manual_seed(sum(shape))
    layer = RMSNorm(shape[-1], eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = (torch.randn(*shape, generator=gen) * 7).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        ref = torch_only(layer, x)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    ulp = (_bits(got).int() - _bits(ref).int()).abs()
    assert ulp.max() <= 1 and (ulp == 0).float().mean() >= 0.99


def test_training_keeps_torchs_path_for_gradients():
    """Under autograd the row ops stay torch's, so gradients flow (they have no backward)."""
    x = torch.randn(3, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _cos_sin(torch.arange(3), 16)
    layer = RMSNorm(16).to(torch.bfloat16)
    assert not rows.rotary_applies(x, cos) and not rows.rmsnorm_applies(x, layer.weight)
    (apply_rotary(layer(x), cos, sin).float().sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_layers_use_the_row_ops():
    """norm.py and rotary.py reach the native module (the seam the tests above switch off)."""
    assert norm_module.rows is rows and rotary_module.rows is rows


@pytest.mark.parametrize("params", [{"rope_type": "default", "rope_theta": 1e6}])
def test_cos_and_sin_from_the_table_are_the_bits_computed_alone(params):
    """Rotary keeps a table of positions; a decode step's row from it, a batch's rows and rows
    beyond the table are what the same ops give at those positions alone."""
    table, alone = rotary_module.Rotary(128, params), rotary_module.Rotary(128, params)
    g = torch.Generator().manual_seed(0)
    asks = [torch.tensor([p]) for p in (0, 7, 300, 8191, 8192, 90000)]
    asks += [torch.randint(0, 9000, (37,), generator=g), torch.randint(0, 50, (5,), generator=g)]
    for positions in asks:
        got, ref = table.cos_sin(positions), alone._make(positions)  # _make: the ops themselves
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), positions
    assert table._table[0].shape[0] <= rotary_module.TABLE_POSITIONS
