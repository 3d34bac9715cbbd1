"""The LoRA pieces on their own: each row gets its own adapter's term (a reference computed row by
row), serving's cached factors follow the optimizer's updates, and the expert op with LoRA equals
the expert computed from its merged weights."""

import torch

from hybridmoe.experts.run.lora import ExpertLoRA, expert_ffn_lora, expert_rows
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.layers import lora
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.lora import LoRA, RowAdapters


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def test_each_row_gets_its_own_adapters_term():
    proj = randomized(Linear(6, 5), 0)
    proj.adapters = {"a": randomized(LoRA(6, 5, 2, 4.0), 1), "b": randomized(LoRA(6, 5, 3, 3.0), 2)}
    x = torch.randn(7, 6)
    rows = RowAdapters([2, 3, 1, 1], ["a", None, "b", "a"])  # rows 0-1 a, 2-4 base, 5 b, 6 a
    with torch.no_grad(), lora.using(rows):
        got = proj(x)
    names = ["a", "a", None, None, None, "b", "a"]
    for i, name in enumerate(names):
        w = proj.weight + (0 if name is None else proj.adapters[name].delta_weight())
        assert torch.allclose(got[i], x[i] @ w.T + proj.bias, atol=1e-5), i


def test_cached_factors_follow_an_in_place_update():
    adapter = randomized(LoRA(4, 3, 2, 2.0), 0)
    x = torch.randn(5, 4)
    with torch.no_grad():
        before = adapter(x)
        adapter.lora_B.add_(1.0)  # what an optimizer step does
        after = adapter(x)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, x @ adapter.delta_weight().T.detach(), atol=1e-5)


def test_the_expert_op_with_lora_equals_the_merged_expert():
    lo = randomized(ExpertLoRA(3, 8, 5, 2, 4.0), 0)
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(10, 8, generator=g), torch.randn(8, 5, generator=g)
    x = torch.randn(4, 8, generator=g)
    e = 2
    merged_gu = gate_up + lo.delta_weight("gate_up", e)
    merged_d = down + lo.delta_weight("down", e)
    gate, up = (x @ merged_gu.T).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ merged_d.T
    with torch.no_grad():
        got = expert_ffn_lora(x, ExpertWeights(gate_up, down), lo, e)
        mixed = expert_rows(x, ExpertWeights(gate_up, down), e, torch.tensor([0, -1, 0, -1]), [lo])
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(mixed[[0, 2]], want[[0, 2]], atol=1e-4)
    gate, up = (x[[1, 3]] @ gate_up.T).chunk(2, dim=-1)
    assert torch.allclose(mixed[[1, 3]], (torch.nn.functional.silu(gate) * up) @ down.T, atol=1e-4)
