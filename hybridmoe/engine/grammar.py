"""Constrained decoding: a request's output held to a grammar (a JSON schema, any JSON object) by
masking, before each token is sampled, every token the grammar does not allow next.

llguidance does the grammar work (a Rust library without dependencies: the token trie and the
Earley parser); the engine keeps one `Constraint` per constrained request, made from the grammar
that `SamplingParams.grammar` carries (llguidance's grammar JSON, `json_grammar`).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import torch


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text following `schema` (None: any JSON object), compact (no free
    whitespace, which a model could emit for ever)."""
    import llguidance

    schema = dict(schema) if schema is not None else {"type": "object"}
    schema.setdefault("x-guidance", {"whitespace_flexible": False})
    return llguidance.grammar_from("json_schema", json.dumps(schema))


def grammar_error(grammar: str) -> str | None:
    """Why llguidance cannot use `grammar` (an unsupported schema feature...), or None."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar) or None


@lru_cache(maxsize=4)
def _tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's view of the tokenizer (its tokens' bytes and trie), made once per tokenizer."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


class Constraint:
    """One request's grammar state: which tokens may come next, and the tokens that came."""

    def __init__(self, grammar: str, hf_tokenizer, vocab_size: int):
        import llguidance

        self.vocab_size = vocab_size
        self.matcher = llguidance.LLMatcher(_tokenizer(hf_tokenizer, vocab_size), grammar)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> the same with every token the grammar forbids next at -inf."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.numel()].astype(bool)  # [V]
        return logits.masked_fill(~torch.from_numpy(allowed), -math.inf)

    def advance(self, token: int) -> bool:
        """Take the sampled `token`; True when the grammar is complete (nothing may follow)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()
