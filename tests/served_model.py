"""A model to serve in tests: a tiny random Mixtral with the real SmolLM2 tokenizer and chat
template, or the demo model once it has been built; and a real uvicorn server around it on a free
port."""

from __future__ import annotations

import functools
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer saved as tokenizer files (hybridmoe.demo.source keeps them cached)."""
    from hybridmoe.demo.source import tokenizer_dir

    return tokenizer_dir()


@functools.cache
def tiny_chat_model() -> Path:
    """A random 2-layer Mixtral (8 experts, top-2) over SmolLM2's 49152-token vocabulary,
    with its tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    out = Path(tempfile.mkdtemp(prefix="hybridmoe-tiny-chat-"))
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    MixtralForCausalLM(cfg).float().save_pretrained(out)
    for f in smollm2_tokenizer_dir().iterdir():
        shutil.copy(f, out / f.name)
    return out


def demo_model() -> Path:
    """The demo model's directory, built on first use like every command does (minutes, once)."""
    from hybridmoe.demo.cache import ensure_demo_model

    return Path(ensure_demo_model())


class ServerThread:
    """uvicorn on 127.0.0.1, on a port the OS picked, in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
