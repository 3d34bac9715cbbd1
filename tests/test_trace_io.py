"""Routing traces on the tensor side: --record-trace writes what the model routed, --routing-trace
makes the model route as the trace says."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hybridmoe.cli.options import attach_observers
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.experts.run.hybrid_runtime import HybridConfig, HybridRuntime
from hybridmoe.experts.run.observers import RoutingReplay, TraceRecorder
from hybridmoe.experts.run.runtime import Step
from hybridmoe.loader import load_model
from tests.tiny import build_tiny
from tests.traces import shared_trace

PROMPT = [5, 9, 14, 33, 2, 71]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "model"
    build_tiny("mixtral", path)  # 2 MoE layers, 8 experts, top-2, renormalised
    return path


def run(path, **options) -> list[int]:
    model = hybrid_model(path, **options)
    tokens = list(generate_ids(model, PROMPT, GREEDY))
    model.runtime.close()
    return tokens


def hybrid_model(path, routing_trace=None, record_trace=None, **options):
    config = HybridConfig(**{"device": "emulated", "cpu_clock": "model", **options})
    model = load_model(
        path,
        runtime_factory=lambda s, d: HybridRuntime(s, d, config, PROFILES["this-machine-2core"]),
        progress=False,
    )
    attach_observers(model, routing_trace, record_trace)
    return model


def random_trace(
    path: Path, lines: int, layers: int = 2, experts: int = 8, k: int = 2, seed: int = 0
) -> list[list[list[int]]]:
    rng = random.Random(seed)
    rows = [[rng.sample(range(experts), k) for _ in range(layers)] for _ in range(lines)]
    path.write_text(
        "".join(json.dumps({"tok": i + 1, "layers": r}) + "\n" for i, r in enumerate(rows))
    )
    return rows


def test_a_recorded_trace_reads_back(mixtral_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    run(mixtral_dir, record_trace=str(out))
    lines = read_trace(out)
    assert len(lines) == GREEDY.max_tokens - 1  # one line per decode step; the prompt is not one
    assert [line.tok for line in lines] == list(range(1, len(lines) + 1))
    for line in lines:
        assert len(line.layers) == 2 and all(
            len(ids) == 2 and len(set(ids)) == 2 for ids in line.layers
        )
        assert line.req == "generate"  # the engine names the request (engine/generate.py's id)
        assert all(
            sum(p) == pytest.approx(1.0, abs=1e-5) for p in line.probs
        )  # Mixtral renormalises


def test_placement_does_not_change_the_recorded_routing(mixtral_dir, tmp_path):
    a, b = tmp_path / "cpu.jsonl", tmp_path / "value.jsonl"
    run(mixtral_dir, policy="cpu", record_trace=str(a))
    run(mixtral_dir, policy="value", budget="0.5", record_trace=str(b))
    assert a.read_text() == b.read_text()


def test_replay_follows_the_trace_exactly(mixtral_dir, tmp_path):
    trace, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = random_trace(trace, lines=40)
    run(mixtral_dir, routing_trace=str(trace), record_trace=str(out))
    recorded = read_trace(out)
    # The prompt's rows take lines 0..P-1; decode step i takes line P + i.
    assert [line.layers for line in recorded] == rows[len(PROMPT) : len(PROMPT) + len(recorded)]
    for line in recorded:  # weights: the router's probabilities at the trace's ids, renormalised
        assert all(sum(p) == pytest.approx(1.0, abs=1e-5) and min(p) > 0 for p in line.probs)


def test_replay_differs_from_the_router_and_placement_still_does_not_matter(mixtral_dir, tmp_path):
    trace = tmp_path / "in.jsonl"
    random_trace(trace, lines=7, seed=3)  # shorter than the run: it cycles
    replayed = run(mixtral_dir, routing_trace=str(trace))
    assert replayed != run(mixtral_dir)
    assert run(mixtral_dir, routing_trace=str(trace), policy="lru", budget="0.25") == replayed


@pytest.mark.parametrize("k,experts,fragment", [(3, 8, "top-k"), (2, 12, "experts per layer")])
def test_a_trace_of_another_model_is_a_clear_error(mixtral_dir, tmp_path, k, experts, fragment):
    trace = tmp_path / "bad.jsonl"
    random_trace(trace, lines=3, k=k, experts=experts, seed=1)
    if experts > 8:  # make sure an out-of-range id is present
        trace.write_text(json.dumps({"tok": 1, "layers": [[11, 0], [1, 2]]}) + "\n")
    with pytest.raises(UserError, match=fragment):
        run(mixtral_dir, routing_trace=str(trace))


def test_concurrent_requests_are_recorded_under_their_ids_as_if_alone(mixtral_dir, tmp_path):
    prompts = {"a": PROMPT, "b": [40, 3, 17, 8]}
    alone = {}
    for name, prompt in prompts.items():
        out = tmp_path / f"{name}.jsonl"
        model = hybrid_model(mixtral_dir, record_trace=str(out))
        LLMEngine(model, config=EngineConfig(max_batch_size=1)).generate([prompt], GREEDY)
        model.runtime.close()
        alone[name] = [line.layers for line in read_trace(out)]
    out = tmp_path / "both.jsonl"
    model = hybrid_model(mixtral_dir, record_trace=str(out))
    engine = LLMEngine(model, config=EngineConfig(max_batch_size=2))
    for name, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, name)
    while engine.has_unfinished():
        engine.step()
    model.runtime.close()
    lines = read_trace(out)
    assert {line.req for line in lines} == {"a", "b"}
    assert len(lines) == 2 * (GREEDY.max_tokens - 1)
    assert any(
        x.req != y.req for x, y in zip(lines, lines[1:3])
    )  # really batched: the ids interleave
    for name in prompts:
        assert [line.layers for line in lines if line.req == name] == alone[name]


def test_recorder_writes_the_rows_the_engine_names(tmp_path):
    out = tmp_path / "t.jsonl"
    rec = TraceRecorder(out, num_moe_layers=2)
    step = Step(3, [(0, "a"), (2, "b")])  # row 1 is a prompt token of another request
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    rec.begin_step(step)
    rec.on_layer(step, 0, ids, torch.full((3, 2), 0.5), {})
    rec.on_layer(step, 1, ids + 1, torch.full((3, 2), 0.5), {})
    rec.end_step(step)
    step = Step(4, [])  # a prompt: nothing recorded
    rec.begin_step(step)
    rec.on_layer(step, 0, ids, torch.ones(3, 2), {})
    rec.close()
    lines = read_trace(out)
    assert [(line.req, line.layers) for line in lines] == [
        ("a", [[1, 2], [2, 3]]),
        ("b", [[5, 6], [6, 7]]),
    ]


def test_the_olmoe_trace_replays_on_a_model_of_its_shape():
    # 18 MoE layers: deeper than the trace's 16
    replay = RoutingReplay.from_file(
        shared_trace("olmoe-1b-7b_299tok.jsonl"), list(range(18)), num_experts=64, top_k=8
    )
    replay.begin_step(Step(2, []))
    assert replay.ids(0).shape == (2, 8)
    assert (
        replay.ids(17).tolist() == replay.ids(1).tolist()
    )  # deeper models cycle the trace's layers


@pytest.fixture(scope="module")
def deep_mixtral(tmp_path_factory):
    """A tiny Mixtral of 4 MoE layers (three horizons of look-ahead from the first) and its
    transformers model, the reference."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.tiny import TINY_COMMON

    torch.manual_seed(4)
    config = MixtralConfig(
        **{**TINY_COMMON, "num_hidden_layers": 4},
        intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config).float().eval()
    with torch.no_grad():  # spread the routers so that the probabilities differ
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("deep-mixtral") / "model"
    model.save_pretrained(path)
    return path, model


@torch.no_grad()
def moe_inputs(model, ids: list[int]) -> list[torch.Tensor]:
    """Each MoE block's input [n, H] over the whole sequence, from transformers' own forward."""
    inputs = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _, args: inputs.append(args[0][0]))
        for layer in model.model.layers
    ]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return inputs


def test_the_recorded_look_ahead_is_the_next_routers_on_this_layers_input(deep_mixtral, tmp_path):
    """The hint of layer i, horizon h: softmax(x_i W_{i+h}^T), x_i the input of MoE block i at the
    token's position, recomputed with transformers' hidden states and router weights."""
    path, reference = deep_mixtral
    out = tmp_path / "trace.jsonl"
    model = hybrid_model(path, record_trace=str(out))
    tokens = list(generate_ids(model, PROMPT, GREEDY))
    model.runtime.close()
    lines = read_trace(out)
    xs = moe_inputs(reference, PROMPT + tokens)
    gates = [layer.mlp.gate.weight for layer in reference.model.layers]
    for t, line in enumerate(lines, 1):
        position = len(PROMPT) + t - 1  # decode step t feeds the token sampled before it
        assert [len(hs) for hs in line.ahead] == [3, 2, 1, 0]
        for i, hs in enumerate(line.ahead):
            for h, got in enumerate(hs, 1):
                want = torch.softmax(xs[i][position] @ gates[i + h].T, dim=-1)  # [E]
                assert got == pytest.approx(want.tolist(), abs=2e-4), (t, i, h)
    # not the layer's own router: the hint says something the routing does not
    own = torch.softmax(xs[0][len(PROMPT)] @ gates[0].T, dim=-1)
    assert lines[0].ahead[0][0] != pytest.approx(own.tolist(), abs=1e-2)


def test_a_trace_without_the_hint_reads_as_before_and_a_bad_one_is_named(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"tok": 1, "layers": [[0, 1], [2, 3]]}) + "\n")
    assert read_trace(plain)[0].ahead is None
    hinted = tmp_path / "hinted.jsonl"
    row = {"tok": 1, "layers": [[0, 1], [2, 3]], "ahead": [[[2500, 7500]], []]}
    hinted.write_text(json.dumps(row) + "\n")
    assert read_trace(hinted)[0].ahead == [[[0.25, 0.75]], []]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**row, "ahead": [[[1, 2]]]}) + "\n")
    with pytest.raises(UserError, match='"ahead" has 1 layers'):
        read_trace(bad)
