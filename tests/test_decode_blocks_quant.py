"""A decode step's blocks on weights kept in GGUF blocks (Q8_0, Q4_K) against the layers' own
paths, step by step inside real engine runs: a layer's attention half in one call (bf16.c's block
calling quant.c's product) and a token's routed experts with their mix (quant.c hm_qmoe_tokens) give
the same bits, so the same logits and tokens as with the native blocks off; and the AVX2 and AVX-512
paths give the same logits through them."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import native
from hybridmoe.experts.run.runtime import CPURuntime
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.decoder import DecoderLayer
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.loader import load_model
from hybridmoe.models.base import CausalLM
from hybridmoe.native import bf16 as native_bf16
from hybridmoe.native import quant as kernels
from tests.gguf_writer import Q, write_gguf
from tests.halves import (
    attention_half_checked,
    decoder_halves_checked,
    layers_loop_off,
    moe_halves_checked,
    torch_threads,
)
from tests.tiny import batch_greedy, build_tiny, build_wide_mixtral

needs_bf16 = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="the attention half needs a CPU with AVX2 and FMA"
)
needs_quant = pytest.mark.skipif(
    kernels.best_isa() == 0, reason="needs AVX2 for the integer kernels"
)
FILES = ["q8_0-qwen3_moe", "q4_k-wide_mixtral"]
BIASED = "q8_0-qwen2_moe"  # q/k/v biases, added to the products in blocks


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """name -> a tiny model's GGUF file, each written once: Qwen3-MoE (per-head q/k norms) and
    Qwen2-MoE (q/k/v biases) in Q8_0, Mixtral 256 wide (every matrix in whole K-quant blocks) in
    Q4_K."""
    made = {}

    def get(name: str) -> str:
        if name not in made:
            qtype, arch = name.split("-")
            hf = tmp_path_factory.mktemp(arch)
            build_wide_mixtral(hf) if arch == "wide_mixtral" else build_tiny(arch, hf, seed=3)
            made[name] = str(write_gguf(hf, hf / f"{name}.gguf", Q[qtype.upper()]))
        return made[name]

    return get


def blocks_off(m: pytest.MonkeyPatch) -> None:
    m.setattr(Attention, "_block_table", lambda *a: None)
    m.setattr(CPURuntime, "_mix_tokens", lambda *a: None)


@needs_bf16
@needs_quant
@pytest.mark.parametrize("name", [*FILES, BIASED])
@pytest.mark.parametrize("threads, least_bytes", [(1, None), (2, None), (2, 0)])
def test_the_attention_half_on_weights_in_blocks_gives_the_layers_bits(
    name, threads, least_bytes, gguf, monkeypatch
):
    """The input norm, q/k/v/o in blocks, the residual sum and the post-attention norm in one
    call against the modules one by one, on every decode step's input: the same outputs and KV
    entries; least_bytes 0: every product shared out over the threads, however small (q, k and v
    in one region on one quantised row)."""
    if least_bytes is not None:
        monkeypatch.setattr(native_bf16, "THREADED_MIN_BYTES", least_bytes)

    model = load_model(gguf(name), dtype=torch.bfloat16, progress=False)
    forward, compared = DecoderLayer.forward, []

    def both(self, x, cos_sin, ctx):
        table = self.self_attn._block_table(x, cos_sin, ctx)
        rows = attention_half_checked(self, x, cos_sin, ctx, monkeypatch, blocks_off)
        if rows is not None:
            assert all(table[16:20].tolist())  # every projection in blocks
            compared.append(rows)
        return forward(self, x, cos_sin, ctx)

    monkeypatch.setattr(DecoderLayer, "forward", both)
    layers_loop_off(monkeypatch)  # every decode step through the layers' own calls
    with torch_threads(threads):
        batch_greedy(model)()
    assert len(compared) > 20 and max(compared) > 1  # decode batches of several sequences too


@needs_quant
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tokens_experts_in_blocks_in_one_call_give_the_runtimes_bits(
    name, dtype, gguf, monkeypatch
):
    """Every MoE layer of every decode token both ways on the same input: hm_qmoe_tokens against
    the runtime's experts_ffn + combine_token, bit for bit, for bf16 and fp32 tokens."""
    model = load_model(gguf(name), dtype=dtype, progress=False)
    moe_halves_checked(model, monkeypatch, in_blocks=True)


@needs_quant
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_moe_half_in_blocks_gives_the_layers_bits(name, dtype, threads, gguf, monkeypatch):
    """SparseMoE.decoder_half with experts in blocks (hm_qmoe_tokens) against the modules through
    the runtime, on every decode step's input of every layer, for bf16 and fp32 tokens."""
    model = load_model(gguf(name), dtype=dtype, progress=False)
    attention_native = dtype == torch.bfloat16 and native.available()
    decoder_halves_checked(model, SparseMoE, monkeypatch, threads, fused_first=attention_native)


def run_logits(path: str, monkeypatch, isa: str, blocks: bool):
    """The batch runner's tokens and every step's logits, the integer kernels on path `isa`, the
    native decode blocks on or off."""
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", isa)
    model, seen = load_model(path, dtype=torch.bfloat16, progress=False), []
    logits = CausalLM.logits

    def spy(self, hidden):
        seen.append(logits(self, hidden))
        return seen[-1]

    with monkeypatch.context() as m:
        m.setattr(CausalLM, "logits", spy)
        if not blocks:
            blocks_off(m)
        with torch.inference_mode():
            tokens = batch_greedy(model)()
    return tokens, seen


@needs_bf16
@needs_quant
@pytest.mark.parametrize("name", FILES)
def test_the_native_blocks_and_both_paths_give_the_same_logits(name, gguf, monkeypatch):
    """Whole runs: the native decode blocks on and off give the same logits at every step and the
    same tokens, and so do the AVX2 paths (with AVX-VNNI and without) and the AVX-512 one with
    the blocks on."""
    path = gguf(name)
    tokens, logits = run_logits(path, monkeypatch, "avx512", blocks=True)
    for isa, blocks in (("avx512", False), ("avxvnni", True), ("avx2", True)):
        other_tokens, other_logits = run_logits(path, monkeypatch, isa, blocks)
        assert other_tokens == tokens and len(other_logits) == len(logits) > 20
        assert all(torch.equal(a, b) for a, b in zip(logits, other_logits))
