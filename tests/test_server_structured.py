"""Structured output with the official openai client against a real server: response_format
json_schema (client.beta.chat.completions.parse with a pydantic model) and json_object, whole and
streamed; a schema the grammar library cannot follow is a 400. The model is a random one, so only
the grammar makes its output parse."""

import json
from enum import Enum

import openai
import pytest
from pydantic import BaseModel, Field

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ASK = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


class Colour(str, Enum):
    red = "red"
    blue = "blue"


class Answer(BaseModel):
    sure: bool
    colour: Colour
    count: int = Field(ge=0, le=99)  # bounded: a random model would write digits for ever


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    tok = load_tokenizer(tiny_chat_model)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, EngineConfig())
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("seed", range(4))
def test_parse_with_a_pydantic_model_gives_an_instance(client, seed):
    r = client.beta.chat.completions.parse(
        model="tiny", messages=ASK, response_format=Answer, max_tokens=60, seed=seed
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Answer)
    assert Answer.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_schema_answer_is_the_same_json(client):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": Answer.model_json_schema(), "strict": True},
    }
    kw = dict(model="tiny", messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    Answer.model_validate_json(whole)


def test_json_object_output_is_json_as_far_as_it_goes(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, max_tokens=40, seed=1
    )
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of JSON, which closing it completes or not
        assert reason == "length"


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema"},
        {"type": "xml"},
    ],
)
def test_a_format_that_cannot_be_followed_is_a_400(client, fmt):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt)
    assert "response_format" in (e.value.body or {}).get("param", "")
