"""Tools with the official openai client against a real server: a model whose chat template takes
tools (a copy of the tiny model with a Hermes-style template) returns `tool_calls`, whole and
streamed, held to the function's parameter schema when the call is forced; a template without tool
support gives a clear 400."""

import json
import shutil

import httpx
import openai
import pytest

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from hybridmoe.server.tools import parse_tool_calls
from tests.served_model import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Hermes / Qwen2.5's way of writing tools and calls, cut down
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions: {% for t in tools %}{{ t | tojson }}{% endfor %}
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ c.function | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def serve(path):
    tok = load_tokenizer(path)
    engine = LLMEngine(load_model(path, progress=False), tok, EngineConfig())
    return ServerThread(create_app(AsyncEngine(engine), tok, "tiny"))


@pytest.fixture(scope="module")
def tool_model(tiny_chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool-model")
    shutil.copytree(tiny_chat_model, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def client(tool_model):
    with serve(tool_model) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_follows_the_functions_schema(client, choice):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, seed=2
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    assert call.id.startswith("call_") and call.type == "function"


def test_a_streamed_call_is_the_same_call(client):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60)
    whole = client.chat.completions.create(**kw, temperature=0).choices[0]
    chunks = list(client.chat.completions.create(**kw, temperature=0, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_a_call_result_goes_back_through_the_template(client):
    first = (
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60
        )
        .choices[0]
        .message
    )
    history = ASK + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


def test_auto_leaves_plain_text_as_content(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=8, seed=0
    )
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason != "tool_calls":
        assert c.message.content and not c.message.tool_calls


def test_a_template_without_tools_is_a_clear_400(tiny_chat_model):
    with serve(tiny_chat_model) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "tools": [WEATHER]},
            timeout=30,
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool support" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},  # no tools
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    ],
)
def test_bad_tool_requests_are_400s(client, extra):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **extra)


def test_calls_are_parsed_out_of_text():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text + "<tool_call>not json</tool_call>")
    assert content == "Let me look.\n<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1})
    ]


def test_a_stream_sends_text_at_once_and_each_call_when_its_block_closes():
    from hybridmoe.server.tools import CallStream

    stream = CallStream()
    text = 'I will look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> Done <tool'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    sent, calls, when = [], [], []
    for i, piece in enumerate(pieces):
        content, found = stream.feed(piece)
        sent.append(content)
        calls += found
        when += [i] * len(found)
    assert "".join(sent) + stream.flush() == "I will look. Done <tool"
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert when == [
        next(i for i, p in enumerate(pieces) if "".join(pieces[: i + 1]).count(">") >= 2)
    ]
    assert "".join(sent[:4]) == "I will look."  # text before the call is not held back
