"""The hybrid runtime on the emulated accelerator: placement never changes the output, copies are
real, the clock respects copy events, and the stats add up."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.run.accelerators import Staging
from hybridmoe.experts.run.hybrid_runtime import HybridConfig, HybridRuntime
from hybridmoe.loader import load_model
from tests.contiguous_kv import SequenceKV, forward_step
from tests.tiny import BUILDERS, tiny_models

ARCHS = [a for a in ("mixtral", "qwen3_moe", "deepseek_v3") if a in BUILDERS]
POLICIES = ("cpu", "static", "fiddler", "hybrimoe", "lru", "lfu", "value")
BUDGETS = ("0", "0.1", "0.5", "1.0")
PROMPT = [3, 17, 5, 42, 8, 11, 2, 29, 64, 7]  # a prefill puts several tokens on some experts
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
COST = PROFILES["this-machine-2core"]  # CPU constants; the emulated GPU borrows rtx4090-ddr5's


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_models(tmp_path_factory)


def hybrid_model(path, **options):
    config = HybridConfig(
        **{"device": "emulated", "cpu_clock": "model", "keep_log": True, **options}
    )
    return load_model(
        path,
        runtime_factory=lambda shape, dtype: HybridRuntime(shape, dtype, config, COST),
        progress=False,
    )


def greedy_tokens(model, prompt=PROMPT) -> list[int]:
    return list(generate_ids(model, prompt, GREEDY))


def prompt_logits(model, prompt=PROMPT) -> torch.Tensor:
    return forward_step(model, SequenceKV(), prompt, 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_placement_never_changes_the_output(arch, tiny_dir):
    path = tiny_dir(arch)
    plain = load_model(path, progress=False)
    reference, reference_logits = greedy_tokens(plain), prompt_logits(plain)
    for policy in POLICIES:
        for budget in BUDGETS:
            model = hybrid_model(path, policy=policy, budget=budget)
            assert torch.equal(prompt_logits(model), reference_logits), (
                f"{policy} at budget {budget}: logits differ"
            )
            assert greedy_tokens(model) == reference, f"{policy} at budget {budget}: tokens differ"
            runtime = model.runtime
            runtime.acc.check()
            if budget == "1.0" and policy != "cpu":  # the GPU path really ran
                assert runtime.stats.total["gpu_runs"] > 0, policy
            runtime.close()


def test_the_demo_model_too(demo_model):
    path = demo_model
    prompt = list(range(100, 112))
    reference = list(generate_ids(load_model(path, progress=False), prompt, GREEDY))
    for policy, budget in (
        ("static", "0.1"),
        ("hybrimoe", "0.1"),
        ("lru", "0.5"),
        ("value", "0.1"),
        ("value", "0.5"),
    ):
        model = hybrid_model(path, policy=policy, budget=budget)
        assert list(generate_ids(model, prompt, GREEDY)) == reference, (
            f"{policy} at budget {budget}"
        )
        model.runtime.acc.check()
        model.runtime.close()


@pytest.mark.parametrize("policy", ["static", "hybrimoe", "lru"])
def test_a_long_prefill_on_a_full_cache_stages_copies_and_keeps_the_output(policy, tiny_dir):
    # Per-layer caches (and static's pinned set) have no room here: the GPU gets experts only
    # through staging buffers.
    path = tiny_dir("qwen3_moe")
    prompt = [(7 * i + 3) % 95 + 1 for i in range(96)]
    reference = prompt_logits(load_model(path, progress=False), prompt)
    model = hybrid_model(path, policy=policy, budget="0.1")
    runtime = model.runtime
    assert runtime.planner.cache.free_count() == 0  # placed full at start
    assert torch.equal(prompt_logits(model, prompt), reference)
    staged = [c for c in runtime.acc.copies if isinstance(c.buffer, Staging)]
    assert staged, "a 96-token prefill should copy some experts over without keeping them"
    runtime.acc.check()
    runtime.close()


def test_slots_hold_exactly_the_store_weights_after_a_run(tiny_dir):
    model = hybrid_model(tiny_dir("mixtral"), policy="lru", budget="0.25")
    greedy_tokens(model)
    runtime = model.runtime
    acc = runtime.acc
    assert acc.copies, "the run should have copied experts"
    for key, slot in runtime.planner.cache.slot_of.items():
        assert acc.buffers.holds[slot] == key
        w = runtime.store.get(*key)
        assert torch.equal(acc.buffers.weights(slot).gate_up, w.gate_up)
        assert torch.equal(acc.buffers.weights(slot).down, w.down)
    runtime.close()


@pytest.mark.parametrize("policy", ["value", "hybrimoe", "fiddler"])
def test_emulated_clock_never_runs_a_gpu_expert_before_its_copy(policy, tiny_dir):
    model = hybrid_model(tiny_dir("qwen3_moe"), policy=policy, budget="0.25")
    greedy_tokens(model)
    acc = model.runtime.acc
    assert acc.runs, "some experts should have run on the GPU"
    for run in acc.runs:
        assert run.start >= run.ready - 1e-12
        assert run.end > run.start
    for copy in acc.copies:
        assert copy.start >= copy.free_at - 1e-12 and copy.end > copy.start
    model.runtime.close()


def test_layer_time_is_the_later_of_cpu_and_gpu(tiny_dir):
    """With the CPU on the model clock, measured layer times equal the planner's prediction."""
    model = hybrid_model(tiny_dir("mixtral"), policy="static", budget="0.5")
    greedy_tokens(model)
    total = model.runtime.stats.total
    assert total["measured_s"] == pytest.approx(total["predicted_s"], rel=1e-9)
    model.runtime.close()


def test_stats_add_up(tiny_dir):
    model = hybrid_model(tiny_dir("mixtral"), policy="value", budget="0.5")
    greedy_tokens(model)
    runtime = model.runtime
    runtime.close()  # closes the last step into the history
    stats = runtime.stats
    t = stats.total
    layers = len(runtime.layers)
    assert stats.steps == GREEDY.max_tokens  # the prompt, then one step per further token
    assert t["tokens"] == len(PROMPT) + GREEDY.max_tokens - 1
    assert t["layers"] == stats.steps * layers
    assert t["hits"] + t["misses"] == t["routed"]
    assert t["cpu_runs"] + t["gpu_runs"] == t["routed"]
    assert t["prefetches_used"] <= t["prefetches_issued"]
    assert (
        t["bytes_copied"]
        == (t["demand_copies"] + t["prefetches_issued"]) * runtime.store.expert_nbytes()
    )
    assert sum(step["routed"] for step in stats.history) == t["routed"]
    assert [step["tokens"] for step in stats.history] == [len(PROMPT)] + [1] * (
        GREEDY.max_tokens - 1
    )
    d = stats.to_dict()
    assert 0.0 <= d["hit_rate"] <= 1.0 and d["slots"] == runtime.planner.cache.slots
    assert "hits" in stats.summary()
    assert d["hits"] == t["hits"]
    assert 0.0 < d["predictor_recall"] <= 1.0


def test_cpu_policy_and_no_accelerator_run_everything_on_the_cpu(tiny_dir):
    path = tiny_dir("mixtral")
    reference = greedy_tokens(load_model(path, progress=False))
    model = hybrid_model(path, policy="value", budget="0.5", device="cpu", cpu_clock="measured")
    assert greedy_tokens(model) == reference
    t = model.runtime.stats.total
    assert (
        t["gpu_runs"] == 0
        and t["cpu_runs"] == t["routed"]
        and model.runtime.planner.cache.slots == 0
    )
    model.runtime.close()


def test_two_cpu_workers_give_the_same_output(tiny_dir):
    path = tiny_dir("qwen3_moe")
    reference = greedy_tokens(load_model(path, progress=False))
    model = hybrid_model(path, policy="static", budget="0.1", cpu_workers=2, cpu_clock="measured")
    assert greedy_tokens(model) == reference
    model.runtime.close()


def test_expert_stats_round_trip_into_frequency_placement(tiny_dir, tmp_path):
    from hybridmoe.cli.options import attach_observers
    from hybridmoe.experts.plan.stats import read_stats

    path, out = tiny_dir("mixtral"), tmp_path / "stats.json"
    model = hybrid_model(path, policy="cpu")
    attach_observers(model, expert_stats_out=str(out))
    greedy_tokens(model)
    model.runtime.close()
    stats = read_stats(out)
    k = model.runtime.shape.top_k
    assert stats.tokens == len(PROMPT) + GREEDY.max_tokens - 1
    assert all(sum(row) == stats.tokens * k for row in stats.counts)
    placed = hybrid_model(
        path, policy="static", budget="0.25", placement="frequency", expert_stats=str(out)
    )
    cache = placed.runtime.planner.cache
    assert set(cache.slot_of) == set(stats.ranked()[: cache.slots])
    placed.runtime.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["static", "fiddler", "value"])
def test_the_cuda_path_gives_the_cpu_tokens(policy, tiny_dir):
    path = tiny_dir("mixtral")
    reference = greedy_tokens(load_model(path, progress=False))
    model = hybrid_model(
        path, policy=policy, budget="0.5", device="cuda", keep_log=False, cpu_clock="measured"
    )
    assert greedy_tokens(model) == reference
    assert model.runtime.stats.total["gpu_runs"] > 0
    model.runtime.close()
