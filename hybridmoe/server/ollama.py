"""Ollama's API beside OpenAI's, as KTransformers serves it: POST /api/generate, POST /api/chat
(streamed as NDJSON lines by default, one JSON object with "stream": false), GET /api/tags.

A request is translated into the OpenAI body it means and validated by the same models
(server/protocol.py), so the limits and errors are the same; errors come back as Ollama's
{"error": message}. Options Ollama has and this server does not (num_ctx, mirostat, ...) are
ignored, as Ollama ignores unknown ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hybridmoe.server.access import require_json
from hybridmoe.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_messages,
    parse,
    parse_json,
    validate,
)

# Ollama's option -> the OpenAI (vLLM) field it means
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    stream: bool = True  # Ollama streams unless told not to
    options: dict = Field(default_factory=dict)
    format: str | dict | None = None


class GenerateBody(_Body):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class ChatBody(_Body):
    messages: list[dict] = Field(min_length=1)
    tools: list | None = None


def openai_body(body: _Body, model: str) -> dict:
    """The OpenAI request fields `body` means (its options renamed; num_predict -1 or -2: none)."""
    if body.format not in (None, ""):
        raise ApiError(400, "'format' is not supported by this server; leave it out.")
    out = {"model": model}
    for name, field in OPTIONS.items():
        if name in body.options:
            out[field] = body.options[name]
    n = body.options.get("num_predict")
    if n is not None and n not in (-1, -2):
        out["max_tokens"] = n
    return out


class OllamaApi:
    def __init__(self, api):
        self.api = api  # app.py's _Api: the engine, the tokenizer, the served names

    async def tags(self, request: Request) -> dict:
        now = datetime.now(timezone.utc).isoformat()
        names = [self.api.model_name, *sorted(self.api.engine.adapters)]
        return {
            "models": [
                {"name": n, "model": n, "modified_at": now, "size": 0, "digest": "", "details": {}}
                for n in names
            ]
        }

    async def generate(self, request: Request):
        try:
            body = await self._read(request, GenerateBody)
            model = self._model(body.model)
            data = openai_body(body, model)
            if body.system and not body.raw and self.api.tokenizer.has_chat_template:
                messages = [{"role": "system", "content": body.system}]
                messages.append({"role": "user", "content": body.prompt})
                return await self._chat(
                    request, body, parse(ChatRequest, data | {"messages": messages})
                )
            req = parse(CompletionRequest, data | {"prompt": body.prompt})
            prompt_ids = self.api.tokenizer.encode(req.prompt)
            return await self._answer(request, body, req, prompt_ids, "response")
        except ApiError as e:
            return _error(e)

    async def chat(self, request: Request):
        try:
            body = await self._read(request, ChatBody)
            if body.tools:
                raise ApiError(400, "'tools' is not supported by this server; leave it out.")
            data = openai_body(body, self._model(body.model)) | {"messages": body.messages}
            return await self._chat(request, body, parse(ChatRequest, data))
        except ApiError as e:
            return _error(e)

    async def _chat(self, request: Request, body: _Body, req: ChatRequest):
        if not self.api.tokenizer.has_chat_template:
            raise ApiError(400, "This model's tokenizer has no chat template; use /api/generate.")
        try:
            prompt_ids = self.api.tokenizer.encode_chat(chat_messages(req))
        except Exception as e:  # the template's own checks
            raise ApiError(400, f"The chat template rejected the messages: {e}") from None
        return await self._answer(request, body, req, prompt_ids, "message")

    async def _read(self, request: Request, cls):
        require_json(request)
        return validate(cls, parse_json(await request.body()))

    def _model(self, name: str) -> str:
        """The served name `name` means ("tiny" and "tiny:latest" alike)."""
        bare = name.removesuffix(":latest")
        if bare == self.api.model_name or bare in self.api.engine.adapters:
            return bare
        raise ApiError(404, f"model '{name}' not found; this server serves '{self.api.model_name}'")

    async def _answer(self, request: Request, body: _Body, req, prompt_ids: list[int], key: str):
        params = self.api.params(req, prompt_ids)
        adapter = self.api._adapter(req)
        outputs = self.api.engine.generate(prompt_ids, params, f"ollama-{time.time_ns()}", adapter)
        lines = _lines(req.model, outputs, key, time.perf_counter())
        if body.stream:
            return StreamingResponse(_ndjson(lines), media_type="application/x-ndjson")
        text, last = [], None
        try:
            async for line in lines:
                text.append(line[key]["content"] if key == "message" else line[key])
                last = line
        except (ValueError, RuntimeError) as e:  # refused (400) or the engine failed (500)
            return _error(ApiError(400 if isinstance(e, ValueError) else 500, str(e)))
        whole = "".join(text)
        last[key] = {"role": "assistant", "content": whole} if key == "message" else whole
        return JSONResponse(last)


async def _lines(model: str, outputs: AsyncIterator, key: str, t0: float) -> AsyncIterator[dict]:
    """Ollama's objects: one per piece of text, the last with done: true and the counts."""
    async for out in outputs:
        piece = {"role": "assistant", "content": out.text} if key == "message" else out.text
        line = {"model": model, "created_at": _now(), key: piece, "done": out.finished}
        if out.finished:
            total = int((time.perf_counter() - t0) * 1e9)
            line |= {
                "done_reason": out.finish_reason,
                "total_duration": total,
                "load_duration": 0,
                "prompt_eval_count": out.prompt_tokens,
                "prompt_eval_duration": int(out.prefill_s * 1e9),
                "eval_count": out.completion_tokens,
                "eval_duration": int(out.decode_s * 1e9),
            }
        if out.text or out.finished:
            yield line


async def _ndjson(lines: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for line in lines:
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except (ValueError, RuntimeError) as e:  # the headers are sent: the error goes in the stream
        yield json.dumps({"error": str(e)}) + "\n"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
