"""The OpenAI-compatible HTTP API over an engine running on its own thread.

    app = create_app(
        AsyncEngine(LLMEngine(model, tokenizer, config)), tokenizer, "my-model", api_key=None
    )
    uvicorn.run(app, host="127.0.0.1", port=10002)

Routes: POST /v1/chat/completions, POST /v1/completions (whole answers, or SSE streams as OpenAI
sends them), GET /v1/models, GET /health, GET /metrics, GET /openapi.json. Every error is a 4xx (a
500 only for a bug) with OpenAI's error body. A client that goes away cancels its request and frees
its KV blocks. Who may call what: server/access.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from hybridmoe.server import metrics
from hybridmoe.server.access import Access, require_json
from hybridmoe.server.async_engine import AsyncEngine
from hybridmoe.server.ollama import OllamaApi
from hybridmoe.server.openapi import document, ollama_paths
from hybridmoe.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_messages,
    parse,
    parse_json,
    sampling_params,
    uses_tools,
)
from hybridmoe.server.responses import ChatShape, CompletionShape, usage

log = logging.getLogger("hybridmoe.server")


def create_app(
    engine: AsyncEngine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    access: Access | None = None,
) -> FastAPI:
    """`api_key` alone, or `access` for a metrics key and CORS origins too."""
    access = access or Access(api_key)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(
        title="hybridmoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    api = _Api(engine, tokenizer, model_name)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    app.get("/v1/models")(api.models)
    ollama = OllamaApi(api)  # Ollama's API beside OpenAI's
    app.post("/api/generate")(ollama.generate)
    app.post("/api/chat")(ollama.chat)
    app.get("/api/tags")(ollama.tags)
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/metrics")(
        lambda: PlainTextResponse(
            metrics.render(engine.metrics_source, model_name),
            media_type="text/plain; version=0.0.4",
        )
    )
    models = [model_name, *sorted(engine.adapters)]
    openapi = document(
        models, engine.vocab_size, ollama_paths(models), secured=access.api_key is not None
    )
    app.get("/openapi.json")(lambda: openapi)
    app.exception_handler(ApiError)(_api_error)
    app.exception_handler(HTTPException)(_http_error)
    app.add_middleware(_Guard, access=access)
    if access.allowed_origins:  # outermost: answers preflights before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


class _Guard:
    """ASGI middleware around every route: refusals by `access`, and a bug's one 500, logged once
    (an exception handler for Exception would log it, then re-raise it to uvicorn: a second
    traceback). Plain ASGI, not BaseHTTPMiddleware, which hides a client's disconnect from the
    routes that watch for it."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        try:
            self.access.check(request)
        except ApiError as e:
            return await (await _api_error(request, e))(scope, receive, send)
        started = False

        async def send_started(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as e:
            response = await _bug(request, e)
            if not started:  # else the answer is under way: the connection just ends
                await response(scope, receive, send)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    message = (
        "Unknown route: see /v1/models, /v1/chat/completions, /v1/completions."
        if e.status_code == 404
        else e.detail
    )
    return JSONResponse(  # e.headers: a 405's Allow
        ApiError(e.status_code, str(message)).body(), status_code=e.status_code, headers=e.headers
    )


async def _bug(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    err = ApiError(
        500,
        f"Internal error ({type(e).__name__}); this is a bug in hybridmoe.",
        type="server_error",
    )
    return JSONResponse(err.body(), status_code=500)


class _Api:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.created = int(time.time())

    async def _body(self, request: Request, cls):
        require_json(request)
        req = parse(cls, parse_json(await request.body()))
        if req.model != self.model_name and req.model not in self.engine.adapters:
            served = ", ".join(f"'{n}'" for n in [self.model_name, *sorted(self.engine.adapters)])
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return req

    def _adapter(self, req) -> str | None:
        """The LoRA adapter a request asked for by its `model`; None for the base model."""
        return None if req.model == self.model_name else req.model

    async def models(self, request: Request) -> dict:
        base = {
            "object": "model",
            "created": self.created,
            "owned_by": "hybridmoe",
            "max_model_len": self.engine.max_model_len,
        }
        adapters = [  # as vLLM lists LoRA adapters: their own id, the base model as parent
            {"id": name, **base, "root": name, "parent": self.model_name}
            for name in sorted(self.engine.adapters)
        ]
        return {"object": "list", "data": [{"id": self.model_name, **base}, *adapters]}

    async def chat(self, request: Request):
        req = await self._body(request, ChatRequest)
        if not self.tokenizer.has_chat_template:
            raise ApiError(
                400,
                "This model's tokenizer has no chat template; use /v1/completions.",
                param="messages",
            )
        tools = [t.model_dump() for t in req.tools] if uses_tools(req) else None
        if tools and not self.tokenizer.supports_tools:
            raise ApiError(
                400,
                "This model's chat template has no tool support, so it cannot be given 'tools'; "
                "leave them out, or serve a model whose template takes tools.",
                param="tools",
            )
        try:
            prompt_ids = self.tokenizer.encode_chat(chat_messages(req), tools)
        except Exception as e:  # the template's own checks (role order, ...) raise from jinja
            raise ApiError(
                400, f"The chat template rejected the messages: {e}", param="messages"
            ) from None
        shape = ChatShape(req.model, self.tokenizer, tools=bool(tools))
        return await self._respond(request, req, prompt_ids, shape)

    async def completions(self, request: Request):
        req = await self._body(request, CompletionRequest)
        prompt = (
            req.prompt[0]
            if isinstance(req.prompt, list) and isinstance(req.prompt[0], str)
            else req.prompt
        )
        if isinstance(prompt, list):
            vocab = self.engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(
                    400,
                    f"'prompt' holds token ids outside the vocabulary [0, {vocab}).",
                    param="prompt",
                )
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.tokenizer.encode(prompt)
        return await self._respond(
            request, req, prompt_ids, CompletionShape(req.model, self.tokenizer)
        )

    def params(self, req, prompt_ids: list[int]):
        """The request's SamplingParams (a 400 if they do not fit the context)."""
        return sampling_params(
            req, len(prompt_ids), self.engine.max_model_len, self.engine.max_tokens_default
        )

    async def _respond(self, request: Request, req, prompt_ids: list[int], shape):
        params = self.params(req, prompt_ids)
        outputs = self.engine.generate(prompt_ids, params, shape.id, self._adapter(req))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(shape, outputs, include_usage, req.return_speed),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(request, shape, outputs, req.return_speed)


async def _whole(request: Request, shape, outputs: AsyncIterator, return_speed: bool) -> Response:
    """Collect the whole answer; a client that disconnects meanwhile cancels the request."""

    async def collect():
        text, logprobs, last = [], None, None
        async for out in outputs:
            text.append(out.text)
            if out.logprobs is not None:
                logprobs = (logprobs or []) + out.logprobs
            last = out
        return "".join(text), logprobs, last

    async def disconnected():
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    task, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()  # raises inside the engine stream, whose `finally` aborts the request
        return Response(status_code=499)
    watch.cancel()
    text, logprobs, last = _result(task)
    body = shape.envelope(
        shape.object,
        shape.whole(text, logprobs, last.finish_reason),
        usage=usage(last, return_speed),
    )
    return JSONResponse(body)


def _result(task: asyncio.Task):
    try:
        return task.result()
    except ValueError as e:  # a RuntimeError (the engine failed) goes on to _bug: a 500
        raise _engine_error(e) from None


def _engine_error(e: Exception) -> ApiError:
    """What the engine's stream raised, for the client: a ValueError is a refusal whose message
    names the fix (a 400); a RuntimeError, the engine failing (a 500)."""
    return ApiError(400 if isinstance(e, ValueError) else 500, str(e))


async def _sse(
    shape, outputs: AsyncIterator, include_usage: bool, return_speed: bool
) -> AsyncIterator[str]:
    """OpenAI's stream: `data: {chunk}` events, the usage chunk if asked for,
    then `data: [DONE]`."""
    extra = {"usage": None} if include_usage else {}
    first = shape.first_chunk()
    if first:
        yield _event(shape.envelope(shape.chunk_object, first, **extra))
    last, sent = None, 0
    try:
        async for out in outputs:
            last = out
            if out.text or out.logprobs or out.finished:
                choices = shape.chunk(out.text, out.logprobs, out.finish_reason, offset=sent)
                if choices:  # none while a tool-call answer is held back
                    yield _event(shape.envelope(shape.chunk_object, choices, **extra))
                sent += len(out.text)
    except (ValueError, RuntimeError) as e:  # the headers are sent: the error goes in the stream
        yield _event(_engine_error(e).body())
    if include_usage and last is not None:
        yield _event(shape.envelope(shape.chunk_object, [], usage=usage(last, return_speed)))
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
