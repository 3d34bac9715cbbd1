"""Two `hybridmoe serve` processes sharing one remote tier (Redis, and Mooncake Store with its
master, metadata server and store processes): a long prompt prefilled by replica A is served by
replica B with only its uncached tail prefilled, and the same answer."""

import random

import pytest

from tests.serve_process import ServeProcess
from tests.services import mooncake_store, redis_server

BLOCK = 16


@pytest.fixture(params=["redis", "mooncake"])
def remote(request):
    if request.param == "redis":
        with redis_server() as (url, _):
            yield url
    else:
        with mooncake_store() as url:
            yield url


def test_replica_b_prefills_only_the_tail_of_a_prompt_replica_a_prefilled(tiny_chat_model, remote):
    flags = ("--prefix-cache-remote", remote, "--block-size", str(BLOCK))
    a, b = ServeProcess(tiny_chat_model, *flags), ServeProcess(tiny_chat_model, *flags)
    try:
        a.wait_ready(), b.wait_ready()
        rng = random.Random()
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randrange(600, 700))]
        first = a.complete(prompt, max_tokens=6)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        a.wait_written()
        cached = (len(prompt) - 1) // BLOCK * BLOCK
        second = b.complete(prompt, max_tokens=6)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert b.metric("prefill_tokens_total") == len(prompt) - cached
        assert b.metric("prefix_cache_remote_hits_total") == cached // BLOCK
        assert b.metric("prefix_cache_loaded_tokens_total") == cached
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert a.metric("prefix_cache_remote_errors_total") == 0
    finally:
        a.stop(), b.stop()
