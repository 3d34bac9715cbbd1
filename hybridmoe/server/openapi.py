"""`GET /openapi.json`: every route and field as the server validates them. The request bodies'
schemas come from the same pydantic models that validate them (server/protocol.py, their ranges
from engine/sampler.py LIMITS), so the document cannot drift from the checks."""

from __future__ import annotations

from pydantic import BaseModel

from hybridmoe.server.protocol import ChatRequest, CompletionRequest

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
REFUSALS = {
    "400": "invalid request (a field named in error.param)",
    "401": "missing or wrong API key",
    "404": "unknown model or route",
    "405": "method not allowed",
    "415": "the body is not application/json",
}
AUTH_ONLY = {"401": REFUSALS["401"], "404": REFUSALS["404"], "405": REFUSALS["405"]}


def document(
    models: list[str], vocab_size: int, extra_paths: dict | None = None, secured: bool = True
) -> dict:
    """The OpenAPI 3.1 document of a server serving `models` (the base model's name, then its
    adapters'), whose token ids lie below `vocab_size`."""
    schemas: dict = {"Error": ERROR}
    chat, completion = _schema(ChatRequest, schemas), _schema(CompletionRequest, schemas)
    for name in ("ChatRequest", "CompletionRequest"):  # another name is a 404
        schemas[name]["properties"]["model"]["enum"] = list(models)
    schemas["ChatRequest"] |= {  # top_logprobs needs logprobs: true
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
    ids["maximum"] = vocab_size - 1
    paths = {
        "/v1/chat/completions": {"post": _post("Chat completion", chat)},
        "/v1/completions": {"post": _post("Text completion", completion)},
        "/v1/models": {"get": _get("The served model and its LoRA adapters", "application/json")},
        "/metrics": {"get": _get("Prometheus metrics", "text/plain")},
        "/openapi.json": {"get": _get("This document", "application/json")},
        "/health": {"get": _get("Liveness probe (no key)", "application/json", secured=False)},
        **(extra_paths or {}),
    }
    doc = {
        "openapi": "3.1.0",
        "info": {"title": f"hybridmoe serving {models[0]}", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def ollama_paths(models: list[str]) -> dict:
    """Ollama's routes (server/ollama.py): their bodies, NDJSON or one object back."""
    from hybridmoe.server.ollama import ChatBody, GenerateBody

    names = [*models, *(f"{m}:latest" for m in models)]
    paths = {}
    for path, cls in (("/api/generate", GenerateBody), ("/api/chat", ChatBody)):
        schema = cls.model_json_schema()
        schema["properties"]["model"]["enum"] = names
        post = _post(cls.__doc__ or path, schema)
        post["responses"]["200"]["content"] = {
            "application/json": {"schema": {"type": "object"}},
            "application/x-ndjson": {"schema": {"type": "object"}},
        }
        # {"error": message} from these routes; the middleware's 401 and a 405 are OpenAI's
        ollama_error = {"type": "object", "properties": {"error": {"type": ["string", "object"]}}}
        for code in REFUSALS:
            post["responses"][code]["content"]["application/json"]["schema"] = ollama_error
        paths[path] = {"post": post}
    paths["/api/tags"] = {
        "get": _get("The served models, as Ollama lists them", "application/json")
    }
    return paths


def _schema(cls: type[BaseModel], schemas: dict) -> dict:
    """Put `cls`'s JSON schema (and the models it uses) in `schemas`; a reference to it."""
    s = cls.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(s.pop("$defs", {}))
    schemas[cls.__name__] = s
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _error_responses(statuses: dict) -> dict:
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {code: {"description": text, "content": body} for code, text in statuses.items()}


def _post(summary: str, body: dict) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {
                "description": "the whole answer, or server-sent events with stream: true",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {  # each event: data: {chunk}, data: [DONE] last
                        "schema": {"type": "object", "properties": {"data": {"type": "string"}}}
                    },
                },
            },
            **_error_responses(REFUSALS),
        },
    }


def _get(summary: str, media: str, secured: bool = True) -> dict:
    schema = {"type": "object"} if media == "application/json" else {"type": "string"}
    out = {
        "summary": summary,
        "responses": {
            "200": {"description": summary, "content": {media: {"schema": schema}}},
            **_error_responses(AUTH_ONLY if secured else {"405": REFUSALS["405"]}),
        },
    }
    if not secured:
        out["security"] = []
    return out
