"""A Hugging Face byte-level BPE tokenizer (tokenizer.json) -> llama.cpp's tokenizer.ggml.* keys:
the vocabulary in id order with each token's type, the merges, the special token ids and flags,
the chat template, and the pre-tokenizer's name.

llama.cpp names the pre-tokenizer (the regex that splits text before BPE) rather than storing it;
its converter finds the name by hashing the tokens of a probe text. Here it is read off the
tokenizer.json's pre_tokenizer instead, for the splits our models' tokenizers use (PRE_TOKENIZERS).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf

from hybridmoe.errors import UserError

log = logging.getLogger("hybridmoe")

# tokenizer.json "Split" regexes -> the llama.cpp pre-tokenizer that splits the same way
_SPLITS = {
    # Qwen2, Qwen3 (and DeepSeek-R1's Qwen distillations)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}
NAMES = ("gpt-2", "smollm", *_SPLITS.values())


def pre_tokenizer_name(pre: dict | None, where: str) -> str:
    """The llama.cpp name of a tokenizer.json pre_tokenizer: GPT-2's byte-level regex alone is
    gpt-2 (OLMoE too), with single digits split first it is smollm (SmolLM2), a Split regex is
    looked up in _SPLITS."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    kinds = [s.get("type") for s in steps]
    # llama.cpp never adds a prefix space to byte-level text
    plain = bool(steps) and not steps[-1].get("add_prefix_space", False)
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and plain:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and plain:
        return "smollm"
    if kinds[:1] == ["Split"] and (regex := steps[0].get("pattern", {}).get("Regex")) in _SPLITS:
        return _SPLITS[regex]
    raise UserError(
        f"{where}: its pre-tokenizer ({', '.join(map(str, kinds)) or 'none'}) is not one whose "
        f"llama.cpp name hybridmoe knows ({', '.join(NAMES)}); export without the tokenizer "
        "(--no-tokenizer) and add it with llama.cpp's converter"
    )


def write_tokenizer(w: gguf.GGUFWriter, directory: Path, vocab_size: int) -> None:
    """Add tokenizer.ggml.* from `directory` (tokenizer.json, tokenizer_config.json), padding
    the vocabulary to the model's `vocab_size` with unused tokens, as llama.cpp's converter does."""
    where = str(directory / "tokenizer.json")
    try:
        spec = json.loads((directory / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: cannot be read ({e}); restore the tokenizer files") from None
    model = spec.get("model", {})
    if model.get("type") != "BPE" or "Ġ" not in model.get("vocab", {}):
        raise UserError(
            f"{where}: a {model.get('type')} tokenizer; GGUF export writes byte-level BPE "
            "tokenizers (GPT-2 style); export with --no-tokenizer"
        )
    tokens, types = _vocabulary(model["vocab"], spec.get("added_tokens", []), vocab_size, where)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer"), where))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(w, quiet=True)


def _vocabulary(vocab: dict, added: list, size: int, where: str) -> tuple[list[str], list[int]]:
    """Tokens in id order and their types: CONTROL for special added tokens, USER_DEFINED for
    other added ones, UNUSED [PADn] where an id has no token."""
    by_id = {i: t for t, i in vocab.items()}
    kinds = {a["id"]: a for a in added}
    by_id.update({i: a["content"] for i, a in kinds.items()})
    if by_id and max(by_id) >= size:
        raise UserError(
            f"{where}: token id {max(by_id)} does not fit the model's vocab_size {size}; "
            "the tokenizer belongs to another model"
        )
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in kinds:
            tokens.append(by_id[i])
            types.append(
                gguf.TokenType.CONTROL if kinds[i].get("special") else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types
