"""Ollama's API beside OpenAI's, tested with the official `ollama` Python client against a real
server: /api/tags, /api/generate and /api/chat, whole and streamed, and the same text as the OpenAI
routes give for the same greedy request."""

import httpx
import ollama
import pytest

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "ollama-key"
GREEDY = {"temperature": 0, "num_predict": 6}
HI = [{"role": "user", "content": "Hello there, who are you?"}]


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    tok = load_tokenizer(tiny_chat_model)
    config = EngineConfig(max_batch_size=4, kv_cache_tokens=4096)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, config)
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny", api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"})


def openai_text(served, path, body) -> str:
    r = httpx.post(
        served.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_tags_list_the_served_model(client):
    assert [m.model for m in client.list().models] == ["tiny"]


def test_generate_whole_and_streamed_equal_the_openai_completion(served, client):
    whole = client.generate(model="tiny", prompt="The capital of France is", options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count <= 6
    pieces = list(
        client.generate(
            model="tiny", prompt="The capital of France is", options=GREEDY, stream=True
        )
    )
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(p.response for p in pieces) == whole.response
    assert pieces[-1].eval_count == whole.eval_count and whole.prompt_eval_count > 0
    body = {
        "model": "tiny",
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
    }
    assert whole.response == openai_text(served, "/v1/completions", body)


def test_chat_whole_and_streamed_equal_the_openai_chat(served, client):
    whole = client.chat(model="tiny:latest", messages=HI, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done
    pieces = list(client.chat(model="tiny", messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].done and pieces[-1].done_reason == whole.done_reason
    body = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 0}
    assert whole.message.content == openai_text(served, "/v1/chat/completions", body)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.chat(model="nope", messages=HI),
        lambda c: c.generate(model="tiny", prompt="hi", options={"temperature": 9}),
        lambda c: c.generate(model="tiny", prompt="hi", options={"repeat_penalty": 5e-324}),
        lambda c: c.generate(model="tiny", prompt="hi", format="json"),
        lambda c: c.chat(model="tiny", messages=[]),
    ],
)
def test_bad_requests_get_ollamas_error(client, call):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert 400 <= e.value.status_code < 500 and e.value.error


def test_the_key_is_required(served):
    no_key = ollama.Client(host=served.url)
    with pytest.raises(ollama.ResponseError) as e:
        no_key.generate(model="tiny", prompt="hi")
    assert e.value.status_code == 401
