"""The demo model's shipped fit (hybridmoe/demo/downs.py): the compact form rounds each weight by at
most half its block's step, a file that does not match is refused, the shipped downs are what the
fit computes, and a full build of the default configuration applies them instead of fitting."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from hybridmoe.demo import downs, source
from hybridmoe.demo.fit import RECIPE_VERSION, start_down
from hybridmoe.demo.spec import DEFAULT_SPEC, LayerMoE, MoESpec


def test_rounding_moves_each_value_by_at_most_half_its_blocks_step():
    torch.manual_seed(0)
    change = torch.randn(6, 4 * downs.BLOCK) * torch.logspace(-6, 0, 6)[:, None]  # [H, F]
    change[2, : downs.BLOCK] = 0.0  # an all-zero block
    codes, scales = downs.encode(change)
    assert codes.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert scales.shape == (6, 4)
    got = downs.decode(codes, scales)
    step = scales.float().repeat_interleave(downs.BLOCK, dim=1)  # [H, F]
    assert (step[[0, 1, 3, 4, 5]] > 0).all()  # down to changes of 1e-6, as one layer's are
    assert ((got - change).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (got[2, : downs.BLOCK] == 0).all()


def small_file(tmp_path, digest="a" * 64):
    """A downs file of 2 layers [H=4, F=64] fitted 'from' the source with `digest`."""
    torch.manual_seed(1)
    spec = MoESpec(experts=2, top_k=1, shared=0.5, ffn=64)
    starts = [torch.randn(4, 64) for _ in range(2)]
    plans = [LayerMoE(None, None, None, s + 0.01 * torch.randn(4, 64)) for s in starts]
    path = tmp_path / "downs.safetensors"
    downs.save(path, plans, starts, spec, RECIPE_VERSION, digest)
    return path, spec, plans, starts


def test_a_file_for_another_source_recipe_or_damaged_is_refused(tmp_path, caplog):
    path, spec, plans, starts = small_file(tmp_path)
    loaded = downs.load(path, spec, RECIPE_VERSION, "a" * 64)
    assert len(loaded) == 2
    for (codes, scales), plan, start in zip(loaded, plans, starts):
        err = (start + downs.decode(codes, scales) - plan.down).abs().max()
        assert err <= 0.01 * 4 / 127  # a few hundredths of the change, not the weights' size
    with caplog.at_level(logging.WARNING, logger="hybridmoe"):
        assert downs.load(path, spec, RECIPE_VERSION, "b" * 64) is None
        assert downs.load(path, spec, RECIPE_VERSION + 1, "a" * 64) is None
        other = MoESpec(experts=4, top_k=1, shared=0.5, ffn=64)
        assert downs.load(path, other, RECIPE_VERSION, "a" * 64) is None
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01  # one bit of one code
        path.write_bytes(bytes(data))
        assert downs.load(path, spec, RECIPE_VERSION, "a" * 64) is None
        path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
        assert downs.load(path, spec, RECIPE_VERSION, "a" * 64) is None
    assert sum("ignoring" in r.getMessage() for r in caplog.records) == 5
    assert downs.load(tmp_path / "absent.safetensors", spec, RECIPE_VERSION, "a" * 64) is None


@pytest.fixture(scope="module")
def dense_two_layers():
    from hybridmoe.demo.build import truncate

    return truncate(*source.read_dense(), 2)


def test_the_shipped_downs_are_what_the_fit_computes(dense_two_layers):
    """The reference: the fit itself, run now on the first two layers (the fit is sequential, so
    they do not depend on later ones). What ships differs from it by the rounding and by float
    noise of another machine's kernels, both far below the change the fit makes."""
    from hybridmoe.demo.fit import fit_model

    dense, config = dense_two_layers
    fitted = fit_model(dense, config, DEFAULT_SPEC, progress=False)
    shipped = downs.shipped_plans(dense, DEFAULT_SPEC, 2, RECIPE_VERSION, source.digest())
    assert shipped is not None, "the default configuration's downs must ship for this source"
    for i, (want, got) in enumerate(zip(fitted, shipped)):
        assert torch.equal(want.experts, got.experts) and torch.equal(want.router, got.router)
        start = start_down(dense[f"model.layers.{i}.mlp.down_proj.weight"], got.experts, 8)
        change = (want.down - start).norm()
        assert change > 1e-3 * start.norm()  # the fit does change the weights
        assert (got.down - want.down).norm() <= 0.02 * change


def test_a_full_build_of_the_default_configuration_applies_the_shipped_fit(tmp_path):
    from hybridmoe.demo.build import build

    out = build(tmp_path / "model", DEFAULT_SPEC, progress=False, layers=2)
    info = json.loads((out / "hybridmoe_demo.json").read_text())
    assert info["downs"] == "shipped" and info["recipe_version"] == RECIPE_VERSION
    dense, _ = source.read_dense()
    plan = downs.shipped_plans(dense, DEFAULT_SPEC, 2, RECIPE_VERSION, source.digest())[1]
    weights = load_file(str(out / "model.safetensors"))
    p = "model.layers.1.mlp"
    assert torch.equal(weights[f"{p}.experts.3.down_proj.weight"], plan.down[:, plan.experts[3]])
    shared = weights[f"{p}.shared_expert.down_proj.weight"]
    assert torch.equal(shared, 2.0 * plan.down[:, plan.shared])


def test_a_reduced_build_fits_instead(tmp_path):
    from hybridmoe.demo.build import build

    out = build(tmp_path / "model", DEFAULT_SPEC, progress=False, layers=1, tokens=1500)
    assert json.loads((out / "hybridmoe_demo.json").read_text())["downs"] == "fitted here"


def test_the_notice_promises_seconds_only_where_the_fit_ships():
    from hybridmoe.demo.cache import FIT_ESTIMATE, SHIPPED_ESTIMATE, build_estimate

    assert build_estimate(DEFAULT_SPEC) == SHIPPED_ESTIMATE
    assert build_estimate(MoESpec(experts=32, top_k=16, shared=0.5)) == FIT_ESTIMATE


def test_refitting_downs_without_a_shipped_split_is_one_line_and_exit_2():
    import subprocess
    import sys

    args = ["--downs", "--experts", "32", "--top-k", "16"]
    out = subprocess.run(
        [sys.executable, "-m", "hybridmoe.demo.fit", *args], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "run without --downs" in out.stderr
