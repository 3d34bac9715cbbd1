"""What OpenAI clients send: request bodies, their validation, and the errors they get back.

Unknown fields are ignored, as OpenAI does. Fields we know but do not support get a 400 that says
so, rather than being silently dropped. Every error is an `ApiError`, rendered as OpenAI's body:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridmoe.engine.sampler import LIMITS, OutOfRange, SamplingParams, check


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: str = Field(json_schema_extra={"const": "text"})  # checked in _check_chat
    text: str | None = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call


class Function(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(None, **LIMITS["max_tokens"])
    temperature: float | None = Field(None, **LIMITS["temperature"])
    top_p: float | None = Field(None, **LIMITS["top_p"])
    top_k: int | None = Field(None, **LIMITS["top_k"])
    min_p: float | None = Field(None, **LIMITS["min_p"])
    presence_penalty: float | None = Field(None, **LIMITS["presence_penalty"])
    frequency_penalty: float | None = Field(None, **LIMITS["frequency_penalty"])
    repetition_penalty: float | None = Field(None, **LIMITS["repetition_penalty"])
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, json_schema_extra={"const": 1})  # checked in parse(), with a clearer message
    ignore_eos: bool = False  # vLLM's extension: benchmarks decode a fixed number of tokens
    return_speed: bool = False  # KTransformers' extension: prefill and decode seconds in usage


class JsonSchema(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **LIMITS["max_tokens"])
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Sampling):
    # one prompt: text, one text in a list, or token ids (each below the vocabulary size)
    prompt: (
        Text
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
    )
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, json_schema_extra={"const": False})  # unsupported: checked below
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})


# fields OpenAI knows that this server does not implement: name -> its harmless value(s)
UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "parallel_tool_calls": (None,),
}


def parse_json(raw: bytes) -> dict:
    """The body as a dict of JSON values that can be written back as UTF-8: no NaN or Infinity
    (not JSON), no lone UTF-16 surrogates (no UTF-8 for them), nesting Python's parser can take."""
    try:
        data = json.loads(raw, parse_constant=_not_json, parse_float=_number)
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400,
            "The request holds a lone UTF-16 surrogate (an escape such as \\ud800 without its "
            "pair), which is not text; send valid Unicode.",
        ) from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, NaN or Infinity
        raise ApiError(
            400, "We could not parse the JSON body of your request: it is not valid JSON."
        ) from None
    except RecursionError:
        raise ApiError(400, "The JSON body is nested too deeply; flatten it.") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return data


def _number(text: str) -> int | float:
    """JSON has one kind of number: 2.0 is the integer 2 (as JSON Schema's "integer" says), so a
    field of whole numbers takes it; 2.5 stays a float (and 1e400, infinity, is refused later)."""
    x = float(text)
    return int(x) if x.is_integer() else x


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def validate(cls: type[BaseModel], data: dict) -> BaseModel:
    """`cls` from `data`; the first problem becomes a 400 naming its field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _union_tag(p))
        raise ApiError(
            400,
            f"Invalid value for '{loc}': {err['msg']}.",
            param=loc or None,
            code="invalid_value",
        ) from None


def parse(cls: type[_Body], data: dict) -> _Body:
    """Validate a request body; the first problem becomes a 400 naming its field."""
    for name, harmless in UNSUPPORTED.items():
        if name in data and data[name] not in harmless:
            raise ApiError(
                400,
                f"'{name}' is not supported by this server; leave it out.",
                param=name,
                code="unsupported_parameter",
            )
    req = validate(cls, data)
    if req.n != 1:
        raise ApiError(
            400,
            f"n={req.n}: this server returns one choice per request (n=1); send several "
            "requests instead.",
            param="n",
            code="unsupported_parameter",
        )
    if isinstance(req, ChatRequest):
        _check_chat(req)
    else:
        _check_completion(req)
    return req


def _union_tag(part) -> bool:
    """Whether a part of pydantic's error location names a member of a union ('str',
    'list[int]', 'constrained-str', 'function-after[...]') rather than a field or an index."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "list", "dict", "none")
        or "-" in part
        or "[" in part
    )


def _check_chat(req: ChatRequest) -> None:
    if not req.messages:
        raise ApiError(400, "'messages' is empty; send at least one message.", param="messages")
    for i, m in enumerate(req.messages):
        for part in m.content if isinstance(m.content, list) else ():
            if part.type != "text":
                raise ApiError(
                    400,
                    f"messages[{i}]: content parts of type '{part.type}' are not supported; "
                    "this model reads text only.",
                    param=f"messages.{i}.content",
                )
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    _check_tools(req)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise ApiError(
            400,
            "'response_format' of type 'json_schema' needs its 'json_schema' (name and schema).",
            param="response_format.json_schema",
        )


def _check_tools(req: ChatRequest) -> None:
    choice = req.tool_choice
    if choice not in (None, "none") and not req.tools:
        raise ApiError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {
        t.function.name for t in req.tools
    }:
        raise ApiError(
            400,
            f"'tool_choice' names '{choice.function.name}', which is not in 'tools'.",
            param="tool_choice",
        )
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise ApiError(
            400,
            "A forced tool call and a 'response_format' cannot both hold the output; drop one.",
            param="response_format",
        )


def uses_tools(req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def _check_completion(req: CompletionRequest) -> None:
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise ApiError(
                400,
                "Several prompts in one request are not supported; send one prompt per request.",
                param="prompt",
                code="unsupported_parameter",
            )
    if not req.prompt or req.prompt == [""]:
        raise ApiError(400, "'prompt' is empty; send some text.", param="prompt")
    if req.echo:
        raise ApiError(
            400,
            "'echo' is not supported by this server; leave it out.",
            param="echo",
            code="unsupported_parameter",
        )
    if req.suffix:
        raise ApiError(
            400,
            "'suffix' is not supported by this server; leave it out.",
            param="suffix",
            code="unsupported_parameter",
        )


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as the chat template wants them: role and plain-text content, and the tool
    calls and answers of earlier turns."""
    from hybridmoe.server.tools import template_arguments

    out = []
    for m in req.messages:
        content = (
            m.content
            if not isinstance(m.content, list)
            else "".join(p.text or "" for p in m.content)
        )
        message = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return template_arguments(out)


def output_grammar(req: _Sampling) -> str | None:
    """The grammar a chat request's forced tool call or response_format holds its output to
    (engine/grammar.py), or None; a schema the grammar library cannot follow is a 400."""
    from hybridmoe.engine.grammar import grammar_error, json_grammar
    from hybridmoe.server.tools import tool_grammar

    choice, fmt = getattr(req, "tool_choice", None), getattr(req, "response_format", None)
    if req_forces_a_call(choice):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        param = "tools"
        make = partial(tool_grammar, [t.model_dump() for t in req.tools], name)
    elif fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
        schema = schema or ({"type": "object"} if fmt.type == "json_schema" else None)
        param = "response_format.json_schema.schema"
        make = partial(json_grammar, schema)
    else:
        return None
    try:
        grammar = make()
        error = grammar_error(grammar)
    except Exception as e:  # the library's own refusal of a schema it cannot read
        grammar, error = None, str(e) or type(e).__name__
    if error:
        raise ApiError(400, f"The JSON schema cannot be followed: {error}", param=param)
    return grammar


def req_forces_a_call(choice) -> bool:
    return choice == "required" or isinstance(choice, NamedToolChoice)


def sampling_params(
    req: _Sampling, prompt_len: int, max_model_len: int, default_max_tokens: int | None = None
) -> SamplingParams:
    """The engine's parameters; the request's max tokens must fit the context beside the prompt.
    Without them: `default_max_tokens` (--max-tokens-default), else the rest of the context."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len}. Shorten the prompt.",
            param="messages" if isinstance(req, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    name = (
        "max_completion_tokens"
        if getattr(req, "max_completion_tokens", None) is not None
        else "max_tokens"
    )
    max_tokens = getattr(req, name)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(
            400,
            f"'{name}' must be at least 1 (got {max_tokens}).",
            param=name,
            code="invalid_value",
        )
    if max_tokens is not None and max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and {max_tokens} more were asked for. Lower '{name}'.",
            param=name,
            code="context_length_exceeded",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    params = SamplingParams(
        grammar=output_grammar(req),
        max_tokens=max_tokens or min(default_max_tokens or room, room),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
    try:
        check(params)
    except OutOfRange as e:
        raise ApiError(400, str(e), param=e.name, code="invalid_value") from None
    return params
