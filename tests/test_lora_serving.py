"""Adapters served: requests with different adapters and none share one continuous batch, each
getting what transformers + peft generate with its own adapter; the prefix cache never hands one
adapter's KV blocks to another; the HTTP server lists adapters in /v1/models and picks one by a
request's `model`."""

from pathlib import Path

import httpx
import openai
import pytest
import torch

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.loader.adapter import load_adapter
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.adapters import peft_model, save_random_adapter
from tests.served_model import ServerThread, tiny_chat_model
from tests.tiny import build_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny Mixtral and two random adapters on it: one on everything, one on attention only."""
    root = tmp_path_factory.mktemp("served-lora")
    build_tiny("mixtral", root / "model")
    maker = load_model(root / "model", progress=False)
    save_random_adapter(maker, root / "a", seed=1)
    save_random_adapter(maker, root / "b", name="b", targets="attention", seed=2)
    return root / "model", root / "a", root / "b"


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft_model(model, adapter)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def test_adapters_and_the_base_model_in_one_batch_each_match_peft(tiny):
    model_dir, a, b = tiny
    model = load_model(model_dir, progress=False)
    load_adapter(model, a, "a")
    load_adapter(model, b, "b")
    engine = LLMEngine(model, None, EngineConfig(max_batch_size=4, block_size=4), eos_ids=())
    prompts = [[3, 17, 42, 5, 9], [8, 1, 30, 2], [3, 17, 42, 5, 9], [50, 51, 52, 53, 54, 55]]
    adapters = ["a", "b", None, "a"]
    ids = [engine.add_request(p, GREEDY, adapter=n) for p, n in zip(prompts, adapters)]
    got = {i: [] for i in ids}
    widest = 0
    while engine.has_unfinished():
        widest = max(widest, len(engine.scheduler.running))
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert widest == 4  # all four decoded in the same passes
    for i, prompt, name in zip(ids, prompts, adapters):
        path = {"a": a, "b": b, None: None}[name]
        assert got[i] == peft_greedy(model_dir, path, prompt), name
    assert got[ids[0]] != got[ids[2]]  # the same prompt, with and without the adapter


def test_the_prefix_cache_keeps_each_adapters_blocks_to_itself(tiny):
    model_dir, a, _ = tiny
    model = load_model(model_dir, progress=False)
    load_adapter(model, a, "a")
    engine = LLMEngine(model, None, EngineConfig(max_batch_size=1, block_size=4), eos_ids=())
    prompt = list(range(10, 30))
    base = engine.generate([prompt], GREEDY)[0]
    engine.add_request(prompt, GREEDY, "with-a", adapter="a")
    with_a = []
    while engine.has_unfinished():
        for out in engine.step():
            with_a += out.token_ids
    assert engine.blocks.hit_tokens == 0  # the base run's blocks were not taken
    assert with_a == peft_greedy(model_dir, a, prompt) != base
    assert engine.generate([prompt], GREEDY)[0] == base  # and its own blocks still serve it
    assert engine.blocks.hit_tokens > 0


def test_an_unknown_adapter_is_refused(tiny):
    model = load_model(tiny[0], progress=False)
    engine = LLMEngine(model, None, EngineConfig(), eos_ids=())
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        engine.add_request([1, 2, 3], GREEDY, adapter="nope")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny chat model served with one adapter, 'custom'."""
    path = tiny_chat_model()
    adapter = tmp_path_factory.mktemp("chat-adapter")
    save_random_adapter(load_model(path, progress=False), adapter, seed=5)
    tok = load_tokenizer(path)
    model = load_model(path, progress=False)
    load_adapter(model, adapter, "custom")
    engine = LLMEngine(model, tok, EngineConfig(max_batch_size=4))
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        server.adapter = adapter
        yield server


def test_models_lists_each_adapter_with_its_base_model(served):
    data = httpx.get(served.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["tiny", "custom"]
    assert data[1]["parent"] == "tiny" and data[1]["object"] == "model"


def test_a_request_naming_the_adapter_runs_with_it(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)
    hi = [{"role": "user", "content": "Hello there, who are you?"}]
    replies = {
        name: client.chat.completions.create(model=name, messages=hi, max_tokens=10, temperature=0)
        for name in ("tiny", "custom")
    }
    assert replies["custom"].model == "custom"
    # the reference: the same model with the same adapter, on its own
    path = tiny_chat_model()
    tok = load_tokenizer(path)
    model = load_model(path, progress=False)
    load_adapter(model, served.adapter, "custom")
    engine = LLMEngine(model, tok, EngineConfig(max_batch_size=1))
    for name, adapter in (("tiny", None), ("custom", "custom")):
        engine.add_request(
            tok.encode_chat(hi), SamplingParams(max_tokens=10, temperature=0), name, adapter
        )
    text = {"tiny": "", "custom": ""}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] += out.text
    assert replies["tiny"].choices[0].message.content == text["tiny"]
    assert replies["custom"].choices[0].message.content == text["custom"] != text["tiny"]


def test_an_unknown_model_is_a_404_naming_what_is_served(served):
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": "other", "prompt": "hi", "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 404
    assert "'tiny', 'custom'" in r.json()["error"]["message"]
