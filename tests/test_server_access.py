"""Auth and exposure: with a key set, every route but /health requires it (/metrics may take a key
of its own); the key can come from a file or HYBRIDMOE_API_KEY, never the process list; POST bodies
must be declared JSON; CORS is off unless origins are given. And the limits: a default for
max_tokens, and a wall-clock limit per request."""

import argparse
import json
import time

import httpx
import openai
import pytest

from hybridmoe.cli import serve
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.errors import UserError
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.access import Access
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.serve_process import ServeProcess
from tests.served_model import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

API, METRICS = "api-secret-1", "metrics-secret-2"
ORIGIN = "http://localhost:3000"
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(tiny_chat_model, tmp_path_factory):
    """`hybridmoe serve` as users run it, its keys in files."""
    keys = tmp_path_factory.mktemp("keys")
    (keys / "api").write_text(API + "\n")
    (keys / "metrics").write_text(METRICS)
    flags = ["--api-key-file", str(keys / "api"), "--metrics-key-file", str(keys / "metrics")]
    flags += ["--allowed-origins", ORIGIN, "--served-model-name", "tiny"]
    flags += ["--max-tokens-default", "3", "--max-model-len", "256"]
    with ServeProcess(tiny_chat_model, *flags) as server:
        yield server


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/nothing"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_but_health_needs_the_key(served, method, path):
    for headers in ({}, bearer("wrong"), bearer(METRICS)):
        r = httpx.request(method, served.url + path, json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, served.url + path, json=BODY, headers=bearer(API), timeout=30)
    assert r.status_code != 401, r.text
    assert httpx.get(served.url + "/health", timeout=10).json() == {"status": "ok"}


def test_metrics_take_their_own_key(served):
    for key, status in ((None, 401), (API, 401), (METRICS, 200)):
        headers = bearer(key) if key else {}
        r = httpx.get(served.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == status, key
    assert "hybridmoe_requests_total" in r.text


def test_the_key_is_not_in_the_process_list(served):
    cmdline = open(f"/proc/{served.proc.pid}/cmdline", "rb").read()
    assert API.encode() not in cmdline and METRICS.encode() not in cmdline


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_post_that_is_not_declared_json_is_refused(served, content_type):
    """A page on another site can send these "simple" requests without a CORS preflight."""
    headers = {"Authorization": f"Bearer {API}"}
    headers |= {"Content-Type": content_type} if content_type else {}
    r = httpx.post(
        served.url + "/v1/completions", content=json.dumps(BODY), headers=headers, timeout=30
    )
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_cors_answers_only_the_allowed_origin(served):
    def preflight(origin):
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        return httpx.options(served.url + "/v1/completions", headers=headers, timeout=10)

    allowed, other = preflight(ORIGIN), preflight("http://evil.example")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers
    r = httpx.post(
        served.url + "/v1/completions", json=BODY, headers=bearer(API) | {"Origin": ORIGIN}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_off_by_default(tiny_chat_model):
    tok = load_tokenizer(tiny_chat_model)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, EngineConfig())
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny", api_key=API)) as server:
        headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = httpx.options(server.url + "/v1/completions", headers=headers, timeout=10)
        assert "access-control-allow-origin" not in r.headers and r.status_code >= 400
        r = httpx.post(
            server.url + "/v1/completions", json=BODY, headers=bearer(API) | {"Origin": ORIGIN}
        )
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def parsed(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_the_key_comes_from_the_environment_a_file_or_the_flag(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.delenv("HYBRIDMOE_API_KEY", raising=False)
    assert serve.server_access(parsed()) == Access()
    assert serve.server_access(parsed("--api-key", "flag")).api_key == "flag"
    assert serve.server_access(parsed("--api-key-file", str(key_file))).api_key == "from-file"
    monkeypatch.setenv("HYBRIDMOE_API_KEY", "from-env")
    assert serve.server_access(parsed()).api_key == "from-env"
    with pytest.raises(UserError, match="more than once"):
        serve.server_access(parsed("--api-key-file", str(key_file)))
    monkeypatch.delenv("HYBRIDMOE_API_KEY")
    (tmp_path / "empty").write_text("\n")
    for flags in (
        ["--api-key-file", str(tmp_path / "empty")],
        ["--api-key-file", str(tmp_path / "missing")],
        ["--metrics-key-file", str(key_file)],  # a metrics key without an API key
        ["--allowed-origins", "localhost:3000"],
    ):
        with pytest.raises(UserError):
            serve.server_access(parsed(*flags))


# ---- limits ----


def test_a_request_without_max_tokens_gets_the_default(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=API, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt="Once", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(
        model="tiny", prompt="Once", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 7  # a request's own max_tokens wins


def test_a_request_past_its_time_limit_ends_with_length(tiny_chat_model):
    tok = load_tokenizer(tiny_chat_model)
    config = EngineConfig(request_timeout=0.3, max_model_len=1024, kv_cache_tokens=2048)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, config)
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        started = time.monotonic()
        r = client.completions.create(
            model="tiny", prompt="Go on", max_tokens=1000, extra_body={"ignore_eos": True}
        )
        assert time.monotonic() - started < 10
        assert r.choices[0].finish_reason == "length" and 0 < r.usage.completion_tokens < 1000
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt="Go on",
                max_tokens=1000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'hybridmoe_requests_timed_out_total{model="tiny"} 2' in metrics
    assert engine.blocks.num_used == 0


def test_a_request_waiting_past_its_time_limit_ends_too(tiny_chat_model):
    """One in the queue (the batch is full) ends without a token, and frees its place."""
    tok = load_tokenizer(tiny_chat_model)
    config = EngineConfig(request_timeout=0.2, max_batch_size=1, max_model_len=1024)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, config)
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    first, second = (engine.add_request(tok.encode("Hi"), long) for _ in range(2))
    # arrived at one instant: else the second's limit can fall just after the step that ends the
    # first, and it is scheduled (and served a token) before it expires
    engine.requests[second].arrived = engine.requests[first].arrived
    ends = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.completion_tokens)
    assert ends[first][0] == "length" and 0 < ends[first][1] < 900
    assert ends[second] == ("length", 0)
    assert engine.metrics.requests_timed_out == 2 and engine.blocks.num_used == 0
