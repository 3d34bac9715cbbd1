"""The HTTP server, as clients see it: the official openai client and plain HTTP against a real
uvicorn server. Every bad request is a 4xx with OpenAI's error body, and the server keeps
serving."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread, tiny_chat_model

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
HI = [{"role": "user", "content": "Hello there, who are you?"}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def start(path, name, **config):
    tok = load_tokenizer(path)
    engine = LLMEngine(load_model(path, progress=False), tok, EngineConfig(**config))
    return ServerThread(create_app(AsyncEngine(engine), tok, name, api_key=KEY)), engine, tok


@pytest.fixture(scope="module")
def served():
    # prefill beside decode, as `hybridmoe serve` runs the CPU runtime on a machine of two
    # cores or more
    server, engine, tok = start(
        tiny_chat_model(),
        "tiny",
        max_batch_size=8,
        max_tokens_per_step=256,
        kv_cache_tokens=4096,
        overlap_prefill=True,
    )
    with server:
        server.engine, server.tok = engine, tok
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(served, path, body, headers=AUTH, timeout=60):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(served.url + path, content=data, headers=headers, timeout=timeout)


def sse_events(response) -> list:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def metric(served, name) -> float:
    text = httpx.get(served.url + "/metrics", headers=AUTH, timeout=10).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"hybridmoe_{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---- answers ----


def test_chat_completion_with_the_openai_client(served, client):
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in (
        "stop",
        "length",
    )
    assert r.usage.prompt_tokens == len(served.tok.encode_chat(HI))
    assert (
        r.usage.total_tokens
        == r.usage.prompt_tokens + r.usage.completion_tokens
        <= r.usage.prompt_tokens + 8
    )


def test_a_greedy_stream_equals_the_whole_answer_and_ends_with_usage(client):
    kw = dict(model="tiny", messages=HI, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_whole_and_streamed_over_plain_http(served):
    body = {
        "model": "tiny",
        "prompt": "The capital of France is",
        "max_tokens": 10,
        "temperature": 0,
    }
    whole = post(served, "/v1/completions", body).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] <= 10
    with httpx.stream(
        "POST",
        served.url + "/v1/completions",
        json={**body, "stream": True},
        headers=AUTH,
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert all("usage" not in e for e in events)  # not asked for


def test_a_stop_string_ends_the_text_before_it(client):
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_reproducible(client):
    kw = dict(
        model="tiny",
        messages=HI,
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.1, "top_k": 50, "min_p": 0.01},
    )
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


def test_logprobs_in_chat_and_completions(served, client):
    r = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(
        c.token == c.top_logprobs[0].token and c.logprob <= 0 for c in content
    )  # greedy: the most likely
    c = post(
        served,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "Hi",
            "max_tokens": 3,
            "logprobs": 2,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert lp["text_offset"][0] == 0 and all(x <= 0 for x in lp["token_logprobs"])


def test_usage_reports_phase_times_when_asked(served):
    body = {"model": "tiny", "messages": HI, "max_tokens": 4, "return_speed": True}
    u = post(served, "/v1/chat/completions", body).json()["usage"]
    assert u["prefill_time"] > 0 and u["decode_time"] >= 0
    assert (
        "prefill_time"
        not in post(served, "/v1/chat/completions", {**body, "return_speed": False}).json()["usage"]
    )


def test_a_repeated_system_prompt_comes_from_the_prefix_cache_and_changes_nothing(served, client):
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    first = client.chat.completions.create(messages=[system, HI[0]], **kw)
    hits = metric(served, "prefix_cache_hit_tokens_total")
    again = client.chat.completions.create(messages=[system, HI[0]], **kw)
    other = client.chat.completions.create(
        messages=[system, {"role": "user", "content": "And you?"}], **kw
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (
        (first.usage.prompt_tokens - 1) // 16
    )
    assert other.usage.prompt_tokens_details.cached_tokens >= 64
    assert metric(served, "prefix_cache_hit_tokens_total") > hits


def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    for name in (
        "requests_total",
        "generation_tokens_total",
        "decode_tokens_per_second",
        "requests_waiting",
        "kv_blocks_used",
        "prefix_cache_hit_tokens_total",
    ):
        assert metric(served, name) >= 0


# ---- bad requests ----

GOOD = {"model": "tiny", "messages": HI, "max_tokens": 2}
BAD = {
    "invalid JSON": ("{not json", 400),
    "not an object": ("[1, 2]", 400),
    "missing messages": ({"model": "tiny"}, 400),
    "empty messages": ({**GOOD, "messages": []}, 400),
    "content of a wrong type": ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400),
    "unknown role": ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "max_tokens as a string": ({**GOOD, "max_tokens": "ten"}, 400),
    "max_tokens 0": ({**GOOD, "max_tokens": 0}, 400),
    "max_completion_tokens negative": ({**GOOD, "max_completion_tokens": -3}, 400),
    "temperature out of range": ({**GOOD, "temperature": 5}, 400),
    "top_p 0": ({**GOOD, "top_p": 0}, 400),
    "n=2": ({**GOOD, "n": 2}, 400),
    "seed out of range": ({**GOOD, "seed": 2**70}, 400),
    "stream not a boolean": ({**GOOD, "stream": "yes"}, 400),
    "repetition_penalty 5e-324": ({**GOOD, "repetition_penalty": 5e-324}, 400),
    "tools": ({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    "an image part": (
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
    ),
    "top_logprobs without logprobs": ({**GOOD, "top_logprobs": 2}, 400),
    "prompt longer than the context": (
        {**GOOD, "messages": [{"role": "user", "content": "word " * 1100}]},
        400,
    ),
    "max_tokens beyond the context": ({**GOOD, "max_tokens": 5000}, 400),
    "unknown model": ({**GOOD, "model": "gpt-4"}, 404),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_is_a_4xx_with_an_error_body(served, case):
    body, status = BAD[case]
    r = post(served, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"]
)
def test_an_api_key_is_required(served, headers):
    r = post(served, "/v1/chat/completions", GOOD, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/models", headers=headers).status_code == 401


def test_bad_completions_and_unknown_routes(served):
    for body in (
        {"model": "tiny", "prompt": ""},
        {"model": "tiny", "prompt": ["a", "b"]},
        {"model": "tiny", "prompt": [1, 99999999]},
        {"model": "tiny", "prompt": "a", "echo": True},
        {"model": "tiny", "prompt": "a", "logprobs": 9},
    ):
        r = post(served, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["message"], body
    assert httpx.get(served.url + "/v1/nothing", headers=AUTH).status_code == 404
    assert httpx.get(served.url + "/v1/nothing").status_code == 401  # no route list without a key
    assert httpx.get(served.url + "/v1/chat/completions", headers=AUTH).json()["error"]["message"]


def test_the_server_keeps_serving_after_bad_requests(served, client):
    for body, _ in BAD.values():
        post(served, "/v1/chat/completions", body)
    assert (
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices[0].message
        is not None
    )


# ---- cancellation and load ----


def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(served):
    aborted = metric(served, "requests_aborted_total")
    body = {
        "model": "tiny",
        "prompt": "Tell me a long story",
        "max_tokens": 900,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", served.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break  # leaving the block closes the connection
    with pytest.raises(httpx.ReadTimeout):
        post(served, "/v1/completions", body, timeout=0.5)
    wait_for(lambda: metric(served, "requests_aborted_total") == aborted + 2)
    wait_for(lambda: metric(served, "kv_blocks_used") == 0 and not served.engine.has_unfinished())


@pytest.fixture(scope="module")
def load_served(demo_model):
    """The load test runs on the demo model, as the issue asks."""
    server, engine, tok = start(
        demo_model,
        "tiny",
        max_batch_size=8,
        max_tokens_per_step=256,
        kv_cache_tokens=2048,
        overlap_prefill=True,
    )
    with server:
        server.engine, server.tok = engine, tok
        yield server


def test_32_concurrent_streams_all_finish_with_no_token_lost_or_duplicated(load_served):
    prompts = [
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Name three colours.",
        "Say hello in French.",
    ]
    n_tokens = 12

    def body(i, stream):
        return {
            "model": "tiny",
            "prompt": prompts[i % 4],
            "max_tokens": n_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "stream": stream,
            "stream_options": {"include_usage": True},
        }

    whole = [
        post(load_served, "/v1/completions", body(i, False)).json()["choices"][0]["text"]
        for i in range(4)
    ]

    async def one(client, i):
        async with client.stream("POST", "/v1/completions", json=body(i, True)) as r:
            assert r.status_code == 200
            events = [
                json.loads(line[6:])
                async for line in r.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        tokens = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        return text, tokens, events[-1]["usage"]["completion_tokens"]

    async def all_clients():
        async with httpx.AsyncClient(base_url=load_served.url, headers=AUTH, timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(32))), timeout=150
            )

    results = asyncio.run(all_clients())
    for i, (text, tokens, completion_tokens) in enumerate(results):
        assert len(tokens) == completion_tokens == n_tokens, i
        assert text == whole[i % 4], i
    wait_for(lambda: metric(load_served, "kv_blocks_used") == 0)


def test_the_expert_runtime_counters_are_exported_when_it_keeps_them():
    from hybridmoe.server.metrics import runtime_metrics

    stats = {"hits": 5, "misses": 2, "demand_copies": 1, "hit_rate": 0.71, "policy": "value"}
    got = {name: value for name, _, _, value in runtime_metrics(stats)}
    assert got == {
        "expert_hits": 5,
        "expert_misses": 2,
        "expert_demand_copies": 1,
        "expert_hit_rate": 0.71,
    }
    assert runtime_metrics({}) == []  # a dense model has no expert runtime
