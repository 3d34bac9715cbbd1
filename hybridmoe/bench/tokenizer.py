"""The benchmark models' tokenizer: SmolLM2's byte-level BPE (shipped with the demo model's source,
no download) cut to a model's vocabulary size. Its ids follow its merges' order, so the first V
tokens with the merges among them are the tokenizer a BPE trainer stops at V tokens makes: every
text still encodes (the byte alphabet comes first) and both hybridmoe and llama.cpp read it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hybridmoe.errors import UserError

FILES = ("tokenizer_config.json", "chat_template.jinja")
SPECIAL = 17  # <|endoftext|>, <|im_start|>, <|im_end|>, ... come first
ALPHABET = 235  # then the byte-level characters the vocabulary uses


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json (cut to `vocab_size` tokens), tokenizer_config.json and the chat template
    into the directory `out`."""
    from hybridmoe.demo.source import tokenizer_dir

    if vocab_size < SPECIAL + ALPHABET:
        raise UserError(
            f"vocab_size {vocab_size}: the benchmark tokenizer needs at least "
            f"{SPECIAL + ALPHABET} tokens (its special tokens and byte alphabet)"
        )
    src = tokenizer_dir()
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < vocab_size}
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [
        m
        for m in spec["model"]["merges"]
        if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab
    ]
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["id"] < vocab_size]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    for name in FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
