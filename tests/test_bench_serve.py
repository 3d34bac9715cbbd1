"""`hybridmoe bench serve`: its two aggregates, computed by hand from known timings, and a run
against a real server that reports its phase times."""

import argparse
import asyncio
import random

import pytest

from hybridmoe.bench.serve import RequestTiming, _level, summarise
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread, tiny_chat_model


def timing(sent, chunks, prompt, completion, prefill=None, decode=None):
    return RequestTiming(
        prompt_tokens=prompt,
        completion_tokens=completion,
        sent=sent,
        chunks=list(chunks),
        server_prefill_s=prefill,
        server_decode_s=decode,
    )


def test_the_window_aggregate_spans_first_token_to_last_and_the_sum_adds_each_requests_speed():
    rng = random.Random()
    a_first, b_first = rng.uniform(1, 2), rng.uniform(5, 6)
    a = timing(
        0.0, [a_first + 0.1 * i for i in range(11)], prompt=100, completion=11
    )  # 10 decode tokens in 1 s
    b = timing(0.0, [b_first + 0.2 * i for i in range(21)], prompt=300, completion=21)  # 20 in 4 s
    r = summarise(128, 2, [a, b])
    window = b.chunks[-1] - a.chunks[0]
    assert r["decode_tps_aggregate"] == pytest.approx(30 / window)
    assert r["decode_tps_sum"] == pytest.approx(10 / 1.0 + 20 / 4.0)
    assert r["prefill_tps_sum"] == pytest.approx(100 / a_first + 300 / b_first)
    assert r["prefill_tps_aggregate"] == pytest.approx(400 / b_first)
    assert r["speed_times"] == "client"
    assert (
        r["decode_tps_sum"] > r["decode_tps_aggregate"]
    )  # b's decode waited for a's window to open


def test_the_sum_takes_the_servers_phase_times_when_it_reports_them():
    prefill, decode = random.uniform(0.5, 1.5), random.uniform(2.0, 3.0)
    a = timing(
        0.0,
        [2.0 + 0.1 * i for i in range(9)],
        prompt=64,
        completion=9,
        prefill=prefill,
        decode=decode,
    )
    r = summarise(64, 1, [a])
    assert r["decode_tps_sum"] == pytest.approx(8 / decode)  # not the client's 8 / 0.8
    assert r["prefill_tps_sum"] == pytest.approx(64 / prefill)
    assert r["decode_tps_per_request"] == pytest.approx(
        8 / 0.8
    )  # the client's own clock, unchanged
    assert r["speed_times"] == "server"
    a.server_decode_s = None  # one request without server times: the level says so
    assert summarise(64, 1, [a])["speed_times"] == "client"


@pytest.mark.usefixtures("one_torch_thread")
def test_a_level_against_a_real_server_uses_its_reported_times():
    path = tiny_chat_model()
    tok = load_tokenizer(path)
    engine = LLMEngine(
        load_model(path, progress=False),
        tok,
        EngineConfig(max_batch_size=4, max_tokens_per_step=64, kv_cache_tokens=2048),
    )
    args = argparse.Namespace(url=None, api_key=None, max_tokens=6, vocab=49152, timeout=120)
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        args.url = server.url
        r = asyncio.run(_level(args, "tiny", 40, 3, random.Random(0)))
    assert r["speed_times"] == "server"
    assert r["requests"] == 3 and r["prompt_tokens"] == 3 * 40 and r["completion_tokens"] == 3 * 6
    assert r["decode_tps_sum"] > 0 and r["prefill_tps_sum"] > 0 and r["decode_tps_aggregate"] > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_the_prefix_scenarios_report_what_the_server_took_from_its_cache(tmp_path):
    from hybridmoe.bench import prefix_scenarios

    path = tiny_chat_model()
    tok = load_tokenizer(path)
    config = EngineConfig(kv_cache_tokens=4096, prefix_cache_dir=str(tmp_path))
    engine = LLMEngine(load_model(path, progress=False), tok, config)
    args = argparse.Namespace(
        api_key=None,
        vocab=49152,
        timeout=120,
        seed=random.randrange(1000),
        max_tokens=4,
        prefix_len=100,
        conversations=2,
        turns=3,
        turn_len=20,
        requests=6,
        tail_len=8,
        at_once=3,
        repeats=2,
        warm_only=False,
    )
    with ServerThread(create_app(AsyncEngine(engine), tok, "tiny")) as server:
        args.url = args.warm_url = server.url
        cached = asyncio.run(prefix_scenarios.cached_prefix(args, "tiny"))
        shared = asyncio.run(prefix_scenarios.shared_prefix(args, "tiny"))
        chat = asyncio.run(prefix_scenarios.multi_turn(args, "tiny"))
    engine.close()
    assert cached["cached_tokens_min"] == 96  # (100 - 1) // 16 blocks, warmed first
    assert len(cached["ttft_cached_s"]) == len(cached["ttft_computed_s"]) == 2
    # the first three arrive together and compute the prefix; the other three share it
    assert shared["prompt_tokens"] == 6 * 108 and shared["cached_tokens"] >= 3 * 96
    # every later turn finds at least the system prompt and the turns before it
    assert chat["cached_tokens"] >= 4 * 96 and chat["turns"] == 3
