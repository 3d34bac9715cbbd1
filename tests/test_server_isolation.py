"""One request never aborts another: any sampling values a client sends are either refused with a
4xx before the request starts or sampled safely, and a request that fails inside the engine ends
alone while the rest of its batch goes on."""

import asyncio
import json
import math

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import LIMITS, SamplingParams, check, sample
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEALTHY_TOKENS = 6
KNOBS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    tok = load_tokenizer(tiny_chat_model)
    config = EngineConfig(
        max_batch_size=8, max_tokens_per_step=256, kv_cache_tokens=4096, overlap_prefill=True
    )
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, config)
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        server.engine = engine
        yield server


def value_near(bounds: dict):
    """Values in range, at its edges, the tiniest floats, and values just outside."""
    low = bounds.get("ge", bounds.get("gt"))
    high = bounds.get("le", 1e9)
    edges = [low, high, 5e-324, 1e-40, 1e-300, -5e-324, math.nextafter(high, math.inf)]
    edges += [math.nextafter(low, -math.inf), low - 1, high + 1, 1e308, -1e308]
    inside = st.floats(min_value=low, max_value=high, exclude_min="gt" in bounds)
    return st.one_of(st.sampled_from(edges), inside, st.floats(), st.integers(-(2**70), 2**70))


def value_inside(bounds: dict):
    """Values the server must accept, the hardest ones often: the edges, the tiniest floats."""
    low, high = bounds.get("ge", bounds.get("gt")), bounds["le"]
    if isinstance(low, int):
        return st.integers(low, min(high, 100_000))
    edges = [x for x in (low, high, 5e-324, 1e-40, 1e-300, 1e-5) if low <= x <= high]
    edges = [x for x in edges if "gt" not in bounds or x > low]
    inside = st.floats(min_value=low, max_value=high, exclude_min="gt" in bounds)
    return st.one_of(st.sampled_from(edges), inside)


ODD = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
KNOB = {name: st.one_of(value_near(LIMITS[name]), ODD) for name in KNOBS}
VALID = st.fixed_dictionaries(
    {}, optional={name: value_inside(LIMITS[name]) for name in KNOBS} | {"stream": st.booleans()}
)
ANY = st.fixed_dictionaries(
    {},
    optional={
        **KNOB,
        "seed": st.one_of(st.integers(-(2**64), 2**65), ODD),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), ODD),
        "logprobs": st.one_of(st.integers(-2, 8), ODD),
        "stream": st.booleans(),
    },
)


def is_valid(body: dict) -> bool:
    """What the server must accept, computed from LIMITS apart from its validation."""
    for name in KNOBS:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if name == "top_k" and not (isinstance(v, int) or v.is_integer()):
            return False  # JSON has one kind of number: 0.0 is the integer 0 (protocol._number)
        b = LIMITS[name]
        if v < b.get("ge", -math.inf) or v <= b.get("gt", -math.inf) or v > b.get("le", math.inf):
            return False
    seed, stop, logprobs = body.get("seed"), body.get("stop"), body.get("logprobs")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
    ):
        return False
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        return False
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 5
    ):
        return False
    return True


async def healthy(client: httpx.AsyncClient, i: int) -> tuple[str | None, int]:
    body = {
        "model": "tiny",
        "prompt": f"Healthy stream number {i} says",
        "max_tokens": HEALTHY_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [
            json.loads(line[6:])
            async for line in r.aiter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    return reasons[-1], events[-1]["usage"]["completion_tokens"]


async def random_request(client: httpx.AsyncClient, knobs: dict) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": "Random knobs", "max_tokens": 8, **knobs}
    data = json.dumps(body)  # NaN and Infinity go out as JSON's non-standard literals
    r = await client.post(
        "/v1/completions", content=data, headers={"Content-Type": "application/json"}
    )
    return r.status_code, r.text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(knobs=st.one_of(VALID, ANY))
def test_random_sampling_values_never_hurt_three_healthy_streams(served, knobs):
    async def together():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.gather(
                random_request(client, knobs), *(healthy(client, i) for i in range(3))
            )

    (status, text), *streams = asyncio.run(together())
    assert streams == [("length", HEALTHY_TOKENS)] * 3
    assert status == (200 if is_valid(knobs) else 400), text
    if status == 200 and knobs.get("stream"):
        assert '"finish_reason":' in text and '"error"' not in text, text


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(
        st.one_of(st.floats(width=32), st.sampled_from([math.inf, -math.inf, math.nan])),
        min_size=2,
        max_size=12,
    ),
    knobs=st.fixed_dictionaries({name: value_near(LIMITS[name]) for name in KNOBS}),
    history=st.lists(st.integers(0, 11), max_size=6),
)
def test_the_sampler_returns_a_token_for_any_value_that_passes_validation(logits, knobs, history):
    params = SamplingParams(**knobs)
    try:
        check(params)
    except ValueError:
        return
    v = len(logits)
    history = [t % v for t in history]
    token = sample(torch.tensor(logits), params, torch.Generator().manual_seed(0), history, history)
    assert 0 <= token < v


def test_a_request_that_fails_in_the_engine_ends_alone(tiny_chat_model):
    """A failure while sampling one sequence (here a NaN temperature set behind validation's back,
    which makes torch.multinomial raise) ends that request with an error; the others in its batch
    decode exactly what they decode without it, and every block is freed."""
    tok = load_tokenizer(tiny_chat_model)
    engine = LLMEngine(load_model(tiny_chat_model, progress=False), tok, EngineConfig())
    prompts = [tok.encode(f"Prompt number {i} goes") for i in range(3)]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = engine.generate(prompts, greedy)
    ids = [engine.add_request(p, greedy) for p in prompts]
    bad = engine.add_request(tok.encode("The bad one"), SamplingParams(max_tokens=5))
    engine.requests[bad].seq.params.temperature = math.nan
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (failed,) = [o for o in outputs if o.request_id == bad]
    assert failed.finished and failed.error and failed.finish_reason is None
    assert [[t for o in outputs if o.request_id == i for t in o.token_ids] for i in ids] == alone
    assert engine.metrics.requests_failed == 1 and engine.metrics.requests_aborted == 0
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["one pass", "prefill beside decode"])
def test_a_request_whose_forward_fails_ends_alone(tiny_chat_model, overlap):
    """A request with a broken LoRA adapter (one factor of the wrong shape: its rows fail in the
    forward pass) ends with an error; the rest of its batch decode what they decode without it."""
    from hybridmoe.models import lora as model_lora
    from tests.adapters import random_adapter

    tok = load_tokenizer(tiny_chat_model)
    model = load_model(tiny_chat_model, progress=False)
    _, modules = random_adapter(model, "broken", "attention")
    next(iter(model_lora.parameters(modules))).data = torch.zeros(3)
    config = EngineConfig(overlap_prefill=overlap, max_batch_size=8)
    engine = LLMEngine(model, tok, config)
    prompts = [tok.encode(f"Prompt number {i} goes") for i in range(3)]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = engine.generate(prompts, greedy)
    ids = [engine.add_request(p, greedy) for p in prompts]
    bad = engine.add_request(tok.encode("The broken one"), greedy, adapter="broken")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (failed,) = [o for o in outputs if o.request_id == bad]
    assert failed.finished and failed.error and not failed.token_ids
    assert [[t for o in outputs if o.request_id == i for t in o.token_ids] for i in ids] == alone
    assert engine.metrics.requests_failed == 1 and engine.blocks.num_used == 0
