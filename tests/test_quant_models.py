"""Models whose weights stay in GGUF blocks: the integer kernels give the tokens of the same model
computed exactly (blocks dequantised, products in fp32), and the AVX2 and AVX-512 paths give the
same tokens. The exact path is what transformers computes (tests/test_gguf.py checks it to 1e-4)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
from hybridmoe.native import quant as kernels
from hybridmoe.quant.tensor import QTensor
from tests.contiguous_kv import SequenceKV, forward_step
from tests.gguf_writer import Q, write_gguf
from tests.held_out import held_out_stats
from tests.tiny import build_tiny, build_wide_mixtral

PROMPT = [5, 17, 42, 8, 30, 2, 64, 11]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def tiny_gguf(tmp_path, arch: str, qtype) -> str:
    build_tiny(arch, tmp_path)
    return str(write_gguf(tmp_path, tmp_path / f"{arch}-{qtype.name}.gguf", qtype))


def wide_mixtral_gguf(tmp_path, qtype) -> str:
    build_wide_mixtral(tmp_path, spread_norms=True)
    return str(write_gguf(tmp_path, tmp_path / f"wide-{qtype.name}.gguf", qtype))


def tokens(path: str, monkeypatch, isa: str) -> list[int]:
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", isa)
    return list(generate_ids(load_model(path, progress=False), PROMPT, GREEDY))


def top_tokens(path: str, ids: list[int], monkeypatch, isa: str) -> list[int]:
    """Teacher-forced: the top token after each prefix of `ids`."""
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", isa)
    model, cache = load_model(path, progress=False), SequenceKV()
    return [int(forward_step(model, cache, [t], i).argmax()) for i, t in enumerate(ids)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_q8_0_tiny_models_agree_with_the_exact_model_on_the_top_token(
    arch, tmp_path, monkeypatch, one_torch_thread
):
    """Random tiny models have nearly flat logits (top-2 margins down to 2e-4 on a 0.5 range), where
    int8 activations' ~1% wobble flips near-ties: so the top token must agree at >= 95% of positions
    here, and greedy decoding must give the same tokens on the trained demo model (below)."""
    path = tiny_gguf(tmp_path, arch, Q.Q8_0)
    model = load_model(path, progress=False)
    assert any(isinstance(m.weight, QTensor) for m in model.modules() if hasattr(m, "quantizable"))
    ids = PROMPT + list(range(20, 60))
    kernel, exact = (
        top_tokens(path, ids, monkeypatch, "avx512"),
        top_tokens(path, ids, monkeypatch, "off"),
    )
    assert sum(a == b for a, b in zip(kernel, exact)) / len(ids) >= 0.95


def test_q8_0_demo_model_keeps_the_exact_models_perplexity(
    demo_model, tmp_path, monkeypatch, one_torch_thread
):
    """The trained demo model written as Q8_0 (its 48-wide expert down projections stay F32, as
    llama.cpp keeps rows that fill no whole block), on held-out text: int8 activations cost at most
    1% of perplexity and the top token agrees at >= 90% of positions (measured: +0.5%, 93.7%; the
    model's outlier features make some blocks' int8 steps coarse, as they do for llama.cpp's
    Q8_0)."""
    path = str(write_gguf(demo_model, tmp_path / "demo-q8_0.gguf", Q.Q8_0))
    (kernel_ppl, kernel_top), (exact_ppl, exact_top) = (
        held_out_stats_with(path, monkeypatch, isa) for isa in ("avx512", "off")
    )
    assert kernel_ppl <= 1.01 * exact_ppl
    assert (kernel_top == exact_top).float().mean() >= 0.9


def held_out_stats_with(path: str, monkeypatch, isa: str) -> tuple[float, torch.Tensor]:
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", isa)
    return held_out_stats(path)


def test_every_instruction_set_path_gives_the_same_tokens(tmp_path, monkeypatch, one_torch_thread):
    path = wide_mixtral_gguf(tmp_path, Q.Q4_K)
    want = tokens(path, monkeypatch, "avx512")
    assert tokens(path, monkeypatch, "avxvnni") == tokens(path, monkeypatch, "avx2") == want


def test_q4_k_agrees_with_the_exact_model_on_the_top_token(tmp_path, monkeypatch, one_torch_thread):
    """Teacher-forced over one sequence: the kernels' top-1 token equals the exact model's at >= 90%
    of positions (4-bit weights are the same; only the activations' int8 rounding differs)."""
    path = wide_mixtral_gguf(tmp_path, Q.Q4_K)
    ids = PROMPT + list(range(20, 60))
    kernel, exact = (
        top_tokens(path, ids, monkeypatch, "avx512"),
        top_tokens(path, ids, monkeypatch, "off"),
    )
    assert sum(a == b for a, b in zip(kernel, exact)) / len(ids) >= 0.9


def test_experts_and_linears_stay_in_their_blocks(tmp_path):
    path = wide_mixtral_gguf(tmp_path, Q.Q4_K)
    model = load_model(path, progress=False)
    w = model.runtime.store.get(0, 1)
    # Q4_K blocks, in rows of eight where the integer kernels run (every path reads them as they
    # lie; quant/interleave.py)
    layout = "q4_k_x8" if kernels.isa() > 0 else "q4_k"
    assert (
        isinstance(w.gate_up, QTensor)
        and w.gate_up.fmt.name == layout
        and w.gate_up.fmt.blocks_of == "q4_k"
        and tuple(w.gate_up.shape) == (512, 256)
    )
    assert model.layers[0].self_attn.q_proj.weight.fmt.name == layout
    assert isinstance(model.layers[0].self_attn.q_proj.weight, QTensor)
    assert isinstance(model.lm_head.weight, QTensor)
    assert model.runtime.store.expert_nbytes() == w.nbytes() == 3 * 256 * 256 * 144 // 256


def test_without_native_kernels_blocks_are_dequantised_and_tokens_are_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    assert not kernels.available()
    path = tiny_gguf(tmp_path, "mixtral", Q.Q8_0)
    assert len(tokens(path, monkeypatch, "off")) == GREEDY.max_tokens


def test_quant_at_load_keeps_a_hugging_face_checkpoint_in_blocks(tmp_path, monkeypatch):
    """--quant q8_0 on a safetensors checkpoint: the same blocks as the Q8_0 GGUF of it (both made
    by llama.cpp's reference quantiser), so the same logits."""
    build_tiny("qwen3_moe", tmp_path)
    gguf_path = write_gguf(tmp_path, tmp_path / "q8.gguf", Q.Q8_0)
    at_load, from_file = (
        load_model(tmp_path, progress=False, quant="q8_0"),
        load_model(gguf_path, progress=False),
    )
    w = at_load.runtime.store.get(1, 3)
    assert isinstance(w.gate_up, QTensor) and isinstance(
        at_load.layers[1].self_attn.o_proj.weight, QTensor
    )
    assert torch.equal(w.gate_up.data, from_file.runtime.store.get(1, 3).gate_up.data)
    assert torch.equal(
        forward_step(at_load, SequenceKV(), PROMPT, 0),
        forward_step(from_file, SequenceKV(), PROMPT, 0),
    )


def test_a_gguf_tensor_type_hybridmoe_does_not_read_is_one_line(tiny_chat_model, tmp_path):
    from tests.console import hybridmoe

    path = write_gguf(tiny_chat_model, tmp_path / "mxfp4.gguf", Q.MXFP4)
    run = hybridmoe(
        "generate",
        "--model",
        path,
        "--tokenizer",
        tiny_chat_model,
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    (line,) = [row for row in run.stderr.splitlines() if "error" in row]
    # the tensor, its type, what is read
    assert "tensor " in line and "MXFP4" in line and "Q4_K" in line
