"""What OpenAI clients receive: the JSON of completions, chunks, usage and logprobs, for both APIs.

`ChatShape` and `CompletionShape` build the same events (a streamed piece, a whole answer) in the
two APIs' layouts, so the handlers in app.py are written once.
"""

from __future__ import annotations

import time
import uuid

from hybridmoe.engine.llm_engine import RequestOutput, TokenLogprob


def usage(out: RequestOutput, return_speed: bool) -> dict:
    u = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }
    if return_speed:  # KTransformers' return_speed: seconds of each phase
        u["prefill_time"], u["decode_time"] = out.prefill_s, out.decode_s
    return u


def choice(logprobs: dict | None, finish_reason: str | None, **content) -> list[dict]:
    """The one choice of a response or chunk: its content (delta, message or text) and ending."""
    return [{"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}]


class _Shape:
    object = chunk_object = id_prefix = ""

    def __init__(self, model: str, tokenizer):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model, self.tokenizer = model, tokenizer
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.hf.decode([token_id], skip_special_tokens=False)


class ChatShape(_Shape):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def first_chunk(self) -> list[dict]:
        return choice(None, None, delta={"role": "assistant", "content": ""})

    def chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        offset: int = 0,
    ) -> list[dict]:
        delta = {"content": text} if text else {}
        return choice(self.logprobs(logprobs), finish_reason, delta=delta)

    def whole(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        offset: int = 0,
    ) -> list[dict]:
        message = {"role": "assistant", "content": text}
        return choice(self.logprobs(logprobs), finish_reason, message=message)

    def logprobs(self, items: list[TokenLogprob] | None) -> dict | None:
        if items is None:
            return None
        return {
            "content": [
                self._entry(t.token_id, t.logprob)
                | {"top_logprobs": [self._entry(i, lp) for i, lp in t.top]}
                for t in items
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionShape(_Shape):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def first_chunk(self) -> list[dict]:
        return []  # the completions API has no role chunk

    def chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        offset: int = 0,
    ) -> list[dict]:
        return choice(self.logprobs(logprobs, offset), finish_reason, text=text)

    whole = chunk

    def logprobs(self, items: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if items is None:
            return None
        tokens = [self.token_text(t.token_id) for t in items]
        offsets, at = [], offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{self.token_text(i): lp for i, lp in t.top} for t in items],
            "text_offset": offsets,
        }
