"""A decode step's MoE layers in one native call (CausalLM._decode_layers, bf16.c
hm_decode_layers_bf16) against each layer calling its own halves, inside real generation: the same
logits at every step and the same tokens, the runtime's observers told the same choices and
handed the same look-ahead hints, for every kind of experts the loop runs (plain bf16, a Qwen2-MoE
block with its shared expert, GGUF blocks); a router whose logits are not finite hands the rest of
the step back to the layers. And the router's softmax and top-k in C (native/rows.h route_row),
which every inference pass takes, against float64 arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import native
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.layers.moe import softmax_topk
from hybridmoe.loader import load_model
from hybridmoe.models.base import CausalLM
from hybridmoe.native import quant as kernels
from hybridmoe.native import rows
from tests.gguf_writer import Q, write_gguf
from tests.halves import layers_loop_off, torch_threads
from tests.tiny import batch_greedy, build_tiny, build_wide_mixtral

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="the decode loop needs a CPU with AVX2 and FMA"
)
needs_quant = pytest.mark.skipif(
    kernels.best_isa() == 0, reason="needs AVX2 for the integer kernels"
)
PROMPT = [5, 17, 3, 40, 9]
TOKENS = 16


def reference_choice(logits: torch.Tensor, k: int, renormalize: bool):
    """softmax and top-k in float64, equal logits in increasing index order: ids, fp32 weights."""
    rows64 = logits.double()  # [T, E]
    ids = torch.tensor(
        [sorted(range(len(row)), key=lambda i, row=row: (-float(row[i]), i))[:k] for row in rows64]
    )  # [T, k]
    weights = F.softmax(rows64, dim=-1).gather(1, ids)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routers_choice_in_c_is_float64s_rounded_once(dtype, renormalize):
    """Random logits (bf16 ones full of ties): the same ids as float64 arithmetic with ties to the
    lower index, weights within an fp32 ulp of it; each row alone gives the bits it has in a
    batch."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 128, generator=gen) * 3).to(dtype)
    ids, weights = rows.softmax_topk(logits, 8, renormalize)
    ref_ids, ref_weights = reference_choice(logits, 8, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1.2e-7, atol=0)
    for t in (0, 17, 63):
        alone = rows.softmax_topk(logits[t : t + 1].clone(), 8, renormalize)
        assert torch.equal(alone[0], ids[t : t + 1]) and torch.equal(alone[1], weights[t : t + 1])
    if dtype == torch.float32:  # torch's fp32 softmax: the same choice (its weights an ulp off)
        probs = F.softmax(logits, dim=-1)
        assert torch.equal(torch.topk(probs, 8).indices, ids)


def test_a_logit_that_is_not_finite_and_a_recorded_gradient_take_torchs_path():
    logits = torch.randn(3, 16)
    logits[2, 7] = float("-inf")  # an expert no router weight can reach: torch's path chooses
    ids, weights = softmax_topk(logits, 4, True)
    assert rows.softmax_topk(logits, 4, True) is None and 7 not in ids[2].tolist()
    assert torch.isfinite(weights).all()
    logits[1, 4] = float("nan")
    assert rows.softmax_topk(logits, 4, True) is None
    ids, weights = softmax_topk(logits, 4, True)  # torch's, as before the native path
    probs = F.softmax(logits, dim=-1)
    want_w, want_ids = torch.topk(probs, 4)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w / want_w.sum(-1, keepdim=True), equal_nan=True)
    trained = torch.randn(2, 16, requires_grad=True)
    assert rows.softmax_topk(trained, 4, True) is None
    assert softmax_topk(trained, 4, True)[1].grad_fn is not None  # the router learns through it


def watched(m, loop: bool, looped) -> list[torch.Tensor]:
    """Under monkeypatch context m: every pass's logits appended to the list returned, and with
    `loop` each call of the decode loop told to looped(x, first layer, layers done); without it,
    the loop off."""
    seen = []
    logits_of, layers_of = CausalLM.logits, CausalLM._decode_layers

    def logits(self, hidden):
        seen.append(logits_of(self, hidden))
        return seen[-1]

    def layers(self, x, cos_sin, ctx, start=0):
        done, out = layers_of(self, x, cos_sin, ctx, start)
        looped(x, start, done)
        return done, out

    m.setattr(CausalLM, "logits", logits)
    if loop:
        m.setattr(CausalLM, "_decode_layers", layers)
    else:
        layers_loop_off(m)
    return seen


def run(model, monkeypatch, loop: bool, threads: int):
    """Greedy generation of TOKENS tokens: (tokens, every step's logits, what the runtime's
    observers saw per layer: the choice and the look-ahead hint, (first layer, layers done) of
    each call of the loop)."""
    looped, observed = [], []

    def on_layer(step, o, ids, weights, report, hint=None):
        observed.append((o, ids.clone(), weights.clone(), None if hint is None else hint(1)))

    with monkeypatch.context() as m:
        seen = watched(m, loop, lambda x, start, done: looped.append((start, done)))
        m.setattr(model.runtime.stats, "on_layer", on_layer)
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        with torch_threads(threads):
            tokens = list(generate_ids(model, PROMPT, params))
    return tokens, seen, observed, looped


def assert_same_runs(model, monkeypatch, threads: int) -> list[int]:
    """The loop on and off give the same bits everywhere; how many layers the loop ran."""
    tokens, logits, observed, looped = run(model, monkeypatch, True, threads)
    tokens_off, logits_off, observed_off, _ = run(model, monkeypatch, False, threads)
    assert tokens == tokens_off and len(tokens) == TOKENS
    assert len(logits) == len(logits_off)
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off))
    assert len(observed) == len(observed_off) > 0
    for (o, ids, w, hint), (o2, ids2, w2, hint2) in zip(observed, observed_off):
        assert o == o2 and torch.equal(ids, ids2) and torch.equal(w, w2)
        assert (hint is None and hint2 is None) or torch.equal(hint, hint2)
    assert any(h is not None for *_, h in observed)  # the hints were handed and compared
    return sum(done for _, done in looped)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_gives_the_layers_bits_on_bf16_experts(arch, threads, tmp_path, monkeypatch):
    """Plain bf16 experts (Qwen3-MoE, Mixtral) and Qwen2-MoE's block with its shared expert: every
    layer of every decode step in the loop, with the bits of the layers' own calls."""
    build_tiny(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch, dtype=torch.bfloat16, progress=False)
    looped = assert_same_runs(model, monkeypatch, threads)
    # every MoE layer of every decode step in the loop (the dense ones of the tiny Qwen2-MoE: not)
    assert looped == (TOKENS - 1) * len(model.runtime.layers)


def gguf_file(name: str, tmp_path) -> str:
    """A tiny model written as GGUF: "q8_0-qwen3_moe" or "q4_k-wide_mixtral"."""
    qtype, arch = name.split("-")
    hf = tmp_path / arch
    build_wide_mixtral(hf) if arch == "wide_mixtral" else build_tiny(arch, hf, seed=3)
    return str(write_gguf(hf, hf / f"{name}.gguf", Q[qtype.upper()]))


@needs_kernels
@needs_quant
@pytest.mark.parametrize("name", ["q8_0-qwen3_moe", "q4_k-wide_mixtral"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_gives_the_layers_bits_on_experts_in_blocks(name, threads, tmp_path, monkeypatch):
    """GGUF blocks (quant.c's hm_qmoe_tokens called from the loop) on every integer path."""
    path = gguf_file(name, tmp_path)
    for isa in ("avx512", "avxvnni", "avx2"):
        monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", isa)
        model = load_model(path, dtype=torch.bfloat16, progress=False)
        assert model.runtime.token_experts(model.runtime.layers[0])[2]  # experts in blocks
        looped = assert_same_runs(model, monkeypatch, threads)
        assert looped == (TOKENS - 1) * len(model.runtime.layers)


@needs_kernels
def test_a_router_with_logits_that_are_not_finite_hands_the_step_back_to_the_layers(
    tmp_path, monkeypatch
):
    """Layer 1's router overflows: the loop stops there and layer 1 runs its own way (torch's
    softmax over an infinity: NaN, and NaN after it), all as without the loop."""
    build_tiny("qwen3_moe", tmp_path / "m", seed=3)
    model = load_model(tmp_path / "m", dtype=torch.bfloat16, progress=False)
    with torch.no_grad():
        model.layers[1].mlp.gate.weight[0] = 3e38  # a product of +-inf
    tokens, logits, _, looped = run(model, monkeypatch, True, 1)
    tokens_off, logits_off, _, _ = run(model, monkeypatch, False, 1)
    assert model.runtime.layers == [1, 2]  # layer 0 dense: its own way, then the loop from 1
    # layer 1's attention ran in the loop, its router stopped it: layer 1 again its own way (the
    # same K and V written); then the loop again from layer 2, which NaN stops; no call in the
    # prompt's pass
    assert looped == [(0, 0), (1, 0), (2, 0)] * (TOKENS - 1)
    assert tokens == tokens_off
    for a, b in zip(logits, logits_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_decode_batches_on_bf16_experts_run_in_the_loop_where_rows_are_alone(
    arch, tmp_path, monkeypatch
):
    """With every row computed as if alone (the serving default), a decode step of several
    sequences on plain bf16 experts (Qwen2-MoE's shared block, one token a call; Qwen3-MoE's, each
    expert once for the step's tokens) runs in the loop: the same logits at every pass and the
    same tokens as the layers."""
    build_tiny(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch, dtype=torch.bfloat16, progress=False)
    tokens, logits, looped = batch_run(model, monkeypatch, True, deterministic_greedy)
    tokens_off, logits_off, _ = batch_run(model, monkeypatch, False, deterministic_greedy)
    assert tokens == tokens_off and len(logits) == len(logits_off) > 20
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off))
    assert 1 in looped and max(looped) > 1  # steps of one sequence and of several


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_decode_batches_run_in_the_loop_where_rows_are_not_alone_and_prompts_do_not(
    arch, tmp_path, monkeypatch
):
    """Plain bf16 experts (Qwen2-MoE's shared block, Qwen3-MoE's) where rows are not computed
    alone (the fastest kernel for each pass's size): a decode step of several sequences, up to
    native.MAX_ROWS, takes the bf16 kernels on either path, and runs in the loop with the layers'
    logits at every pass; the passes with a prompt chunk go through the layers."""
    build_tiny(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch, dtype=torch.bfloat16, progress=False)
    passes, in_loop = [], set()  # (new tokens, decode tokens) of each pass; the passes looped
    forward, layers_of = CausalLM.forward, CausalLM._decode_layers

    def counted(self, input_ids, positions, ctx, decode_rows=()):
        passes.append((len(input_ids), len(decode_rows)))
        return forward(self, input_ids, positions, ctx, decode_rows)

    def layers(self, x, cos_sin, ctx, start=0):
        done, out = layers_of(self, x, cos_sin, ctx, start)
        if done:
            in_loop.add(len(passes) - 1)
        return done, out

    monkeypatch.setattr(CausalLM, "forward", counted)
    monkeypatch.setattr(CausalLM, "_decode_layers", layers)
    tokens, logits, looped = batch_run(model, monkeypatch, True)
    tokens_off, logits_off, _ = batch_run(model, monkeypatch, False)
    assert tokens == tokens_off and len(logits) == len(logits_off) > 20
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off))
    assert 1 in looped and max(looped) > 1  # steps of one sequence and of several
    assert any(n > d for n, d in passes)  # passes with prompt chunks ran, none in the loop
    assert in_loop and all(passes[i][0] == passes[i][1] for i in in_loop)


def deterministic_greedy(model):
    """batch_greedy's prompts through an engine that computes every row as if alone (the
    serving default, --deterministic on)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (1, 5, 17, 33, 9, 40)]

    def generate() -> list[list[int]]:
        config = EngineConfig(block_size=4, max_batch_size=4, max_tokens_per_step=24)
        assert config.deterministic
        eng = LLMEngine(model, None, config, eos_ids=())
        return eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0), max_steps=500)

    return generate


def batch_run(model, monkeypatch, loop: bool, runner=batch_greedy):
    """An engine run of six prompts in decode batches of up to four sequences (batch_greedy's, or
    `runner`'s): its tokens, every pass's logits, and the rows of each pass the loop ran layers
    of."""
    looped = []
    with monkeypatch.context() as m:
        seen = watched(m, loop, lambda x, start, done: looped.extend([x.shape[0]] * done))
        with torch.inference_mode():
            tokens = runner(model)()
    return tokens, seen, looped


@needs_kernels
@needs_quant
@pytest.mark.parametrize("name", ["q8_0-qwen3_moe", "q4_k-wide_mixtral"])
def test_decode_batches_on_experts_in_blocks_run_in_the_loop_with_the_layers_bits(
    name, tmp_path, monkeypatch
):
    """Experts in blocks take a decode step of several sequences (the runtime mixes any count of
    tokens in one call): the loop runs those steps too, with the same logits at every pass and the
    same tokens as the layers."""
    model = load_model(gguf_file(name, tmp_path), dtype=torch.bfloat16, progress=False)
    tokens, logits, looped = batch_run(model, monkeypatch, loop=True)
    tokens_off, logits_off, _ = batch_run(model, monkeypatch, loop=False)
    assert tokens == tokens_off and len(logits) == len(logits_off) > 20
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_off))
    assert 1 in looped and max(looped) > 1  # steps of one sequence and of several


def counting_plans(m) -> list[int]:
    """Under monkeypatch context m: how many layers' checks (DecoderLayer.decode_fields) each
    generation's plans ran, appended per call."""
    from hybridmoe.layers.decoder import DecoderLayer

    calls, fields_of = [0], DecoderLayer.decode_fields

    def fields(self, *args):
        calls[0] += 1
        return fields_of(self, *args)

    m.setattr(DecoderLayer, "decode_fields", fields)
    return calls


@needs_kernels
def test_a_plan_is_kept_across_steps_and_made_again_when_what_it_read_changes(
    tmp_path, monkeypatch
):
    """The layers' checks run once per generation (its first decode step), not at every step;
    the plan is made again for a new KV cache, a new thread count, a store that changed, an
    adapter attached to a dict of adapters, replayed routing, and the kept plan gives the layers'
    bits throughout (assert_same_runs)."""
    build_tiny("qwen3_moe", tmp_path / "m", seed=3)
    model = load_model(tmp_path / "m", dtype=torch.bfloat16, progress=False)
    layers = len(model.runtime.layers)  # MoE layers 1 and 2; layer 0 is dense
    with monkeypatch.context() as m:
        calls = counting_plans(m)
        assert_same_runs(model, monkeypatch, 1)
        # loop on: every layer checked once for its TOKENS - 1 decode steps (from layer 0: no
        # plan, the dense layer; from 1: layers 1 and 2); then the loop-off run, not counted here
        layers = len(model.layers)
        assert calls[0] == layers
        calls[0] = 0
        run(model, monkeypatch, True, 1)  # another engine: another KV cache, a new plan
        assert calls[0] == layers
        calls[0] = 0
        run(model, monkeypatch, True, 2)  # two threads: the experts' threads differ
        assert calls[0] == layers
        # the store changed: expert 0 of the first MoE layer put again, scaled: a new table
        layer = model.runtime.layers[0]
        w = model.runtime.store.records[(layer, 0)]
        inter = model.runtime.shape.intermediate
        gate, up = w.gate_up[:inter], w.gate_up[inter:]
        model.runtime.store.put(layer, 0, gate * 2, up, w.down)
        calls[0] = 0
        assert_same_runs(model, monkeypatch, 1)
        assert calls[0] == layers

    # an adapter attached to the q projections: every layer declines the loop; detached, the
    # loop takes them all again
    from hybridmoe.models import lora

    lora.attach(lora.select(model, "q_proj"), "a", 2, 4.0)
    tokens, _, _, looped = run(model, monkeypatch, True, 1)
    assert sum(done for _, done in looped) == 0 and len(tokens) == TOKENS
    lora.detach(model, "a")
    _, _, _, looped = run(model, monkeypatch, True, 1)
    assert sum(done for _, done in looped) == (TOKENS - 1) * len(model.runtime.layers)
