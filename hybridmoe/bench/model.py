"""Benchmark models: random weights with the layer shapes of a real MoE, saved by transformers.

Random weights make routing close to uniform, which is what decode of a real model looks like to
the memory system (each token touches top_k fresh experts per layer); the speed of a layer depends
only on its shapes, so a few layers with real shapes give per-layer figures of the real model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

# Layer shapes of Qwen3-30B-A3B (its config.json), with a small vocabulary so that the embedding and
# the LM head do not dominate a model of a few layers.
SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        vocab_size=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # the same structure (32/4 heads, 128 experts, top-8) at tiny widths: for tests, and to measure
    # per-step dispatch overhead alone, since its matmuls take next to no time
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        vocab_size=256,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def build_reference(shape: str, layers: int, dtype: torch.dtype, seed: int = 0):
    """A random-weight transformers Qwen3MoeForCausalLM with `shape`'s layers,
    made directly in `dtype`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known are {', '.join(SHAPES)}")
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**SHAPES[shape], num_hidden_layers=layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(
        dtype
    )  # build in bf16 directly: the fp32 copy of 30B-shaped layers is 2x the RAM
    try:
        model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def make_model(
    shape: str, layers: int, out: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """Build and save a benchmark model into `out`,
    atomically (a temporary sibling, then a rename)."""
    out = Path(out).expanduser().resolve()
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    model = build_reference(shape, layers, dtype, seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        from hybridmoe.bench.tokenizer import write_tokenizer

        write_tokenizer(tmp, model.config.vocab_size)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary model directory
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
