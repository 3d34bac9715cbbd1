"""Tokenizer and chat template, from a model directory, a GGUF file's metadata,
or --tokenizer DIR."""

from __future__ import annotations

import logging
from pathlib import Path

from hybridmoe.errors import ModelFileError


class Tokenizer:
    """Text <-> ids, the chat template, stop ids, and streaming detokenisation."""

    def __init__(self, hf_tokenizer, extra_eos: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = set(extra_eos)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template writes a `tools` list into the prompt."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def chat_prompt(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        if not self.has_chat_template:
            raise ModelFileError(
                "this model's tokenizer has no chat template; use a plain prompt "
                "or a tokenizer that has one (--tokenizer DIR)"
            )
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        # The template already writes the special tokens (BOS etc.); do not add them twice.
        return self.encode(self.chat_prompt(messages, tools=tools), add_special_tokens=False)


class Detokenizer:
    """Turns a growing list of ids into text increments, holding back incomplete characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids or [])[
            -4:
        ]  # a little left context for word boundaries
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before) :]
        return ""


def load_tokenizer_dir(directory: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    if not any(
        (directory / f).exists()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        raise ModelFileError(
            f"{directory}: no tokenizer (tokenizer.json or tokenizer.model); "
            "copy the model's tokenizer files there or pass --tokenizer DIR"
        )
    try:
        with _quiet_transformers():
            return Tokenizer(AutoTokenizer.from_pretrained(str(directory)))
    except Exception as e:
        raise ModelFileError(
            f"{directory}: the tokenizer cannot be loaded ({str(e).splitlines()[0]}); "
            "restore its tokenizer files or pass --tokenizer DIR"
        ) from None


def load_tokenizer_gguf(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    from hybridmoe.loader import gguf_file

    gguf_file.check(path)  # a damaged file gets its own message, not "no tokenizer"
    try:
        with _quiet_transformers():
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        _split_as_llama_cpp(hf, gguf_file.metadata(path).get("tokenizer.ggml.pre"))
        return Tokenizer(hf)
    except Exception as e:
        raise ModelFileError(
            f"{path}: no usable tokenizer in its metadata ({str(e).splitlines()[0]}); "
            "pass --tokenizer DIR with the model's tokenizer files"
        ) from None


def _split_as_llama_cpp(hf, pre: str | None) -> None:
    """transformers' GGUF reader knows no split for llama.cpp's "smollm" pre-tokenizer (SmolLM's),
    which splits digits one by one before GPT-2's byte-level regex; without it numbers would
    tokenize otherwise than in llama.cpp and in SmolLM's own tokenizer."""
    if pre == "smollm":
        from tokenizers import pre_tokenizers

        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )


class _quiet_transformers:
    """transformers logs warnings about unused GGUF keys and such; the user did nothing wrong."""

    def __enter__(self):
        self.logger = logging.getLogger("transformers")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
