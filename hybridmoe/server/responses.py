"""What OpenAI clients receive: the JSON of completions, chunks, usage and logprobs, for both APIs.

`ChatShape` and `CompletionShape` build the same events (a streamed piece, a whole answer) in the
two APIs' layouts, so the handlers in app.py are written once.
"""

from __future__ import annotations

import time
import uuid

from hybridmoe.engine.llm_engine import RequestOutput, TokenLogprob
from hybridmoe.server.tools import CallStream, parse_tool_calls


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
    """`tools`: the answer may hold tool calls (server/tools.py): a stream holds back only what
    may be a call being written, and sends each call when its block closes."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, tokenizer, tools: bool = False):
        super().__init__(model, tokenizer)
        self.tools, self.calls, self.sent_calls = tools, CallStream(), 0

    def first_chunk(self) -> list[dict]:
        return choice(None, None, delta={"role": "assistant", "content": ""})

    def chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        offset: int = 0,
    ) -> list[dict]:
        if self.tools:
            return self._held_chunk(text, logprobs, finish_reason)
        delta = {"content": text} if text else {}
        return choice(self.logprobs(logprobs), finish_reason, delta=delta)

    def _held_chunk(self, text, logprobs, finish_reason) -> list[dict]:
        content, calls = self.calls.feed(text)
        if finish_reason is not None:
            content += self.calls.flush()
        delta = {"content": content} if content.strip() else {}
        if calls:
            delta["tool_calls"] = [{"index": self.sent_calls + i, **c} for i, c in enumerate(calls)]
            self.sent_calls += len(calls)
        if finish_reason is not None and self.sent_calls:
            finish_reason = "tool_calls"
        if not delta and finish_reason is None and not logprobs:
            return []
        return choice(self.logprobs(logprobs), finish_reason, delta=delta)

    def whole(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        offset: int = 0,
    ) -> list[dict]:
        message = {"role": "assistant", "content": text}
        if self.tools:
            content, calls = parse_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = "tool_calls"
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
