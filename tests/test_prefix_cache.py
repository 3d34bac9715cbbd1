"""The prefix cache below the device pool: block identity, the block codec, the RAM, disk and remote
tiers, and the engine serving from them. References: transformers' greedy tokens for outputs, and
the KV entries a fresh engine computes for blocks that were loaded."""

import logging
import os
import random
import signal
from contextlib import contextmanager

import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.prefix_cache.codec import CorruptBlock, decode, encode
from hybridmoe.engine.prefix_cache.disk_tier import DiskTier
from hybridmoe.engine.prefix_cache.identity import chain_keys
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.errors import UserError
from hybridmoe.loader import load_model
from tests.console import hybridmoe
from tests.services import free_port, mooncake_store, redis_server
from tests.tiny import build_tiny

GREEDY = SamplingParams(max_tokens=8, temperature=0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny Mixtrals of one shape and vocabulary (seeds 3 and 4): transformers' and ours."""
    models = {}
    for seed in (3, 4):
        out = tmp_path_factory.mktemp(f"mixtral-{seed}")
        models[seed] = build_tiny("mixtral", out, seed=seed), load_model(out, progress=False), out
    return models


def hf_greedy(ref, prompt, n=GREEDY.max_tokens):
    ref.generation_config.eos_token_id = None
    ids = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt) :].tolist()


def prompt(n, seed):
    return torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, **kw):
    return LLMEngine(model, None, EngineConfig(**{"block_size": 4, **kw}), eos_ids=())


def block_rows(eng, key):
    """The entries the engine's pool holds for the block `key`."""
    return eng.runner.kv.read_block(eng.blocks.by_key[key].id)


# ---- identity and codec ----


def test_a_key_names_the_whole_prefix_through_one_model():
    tokens = prompt(40, seed=1)
    a = chain_keys(b"model-a", tokens, 4, 0, 10)
    assert a == chain_keys(b"model-a", tokens, 4, 0, 10) and len(set(a)) == 10
    assert not set(a) & set(chain_keys(b"model-b", tokens, 4, 0, 10))  # another model: all differ
    changed = list(tokens)
    changed[5] += 1  # a token of block 1: blocks 1.. change, block 0 stays
    b = chain_keys(b"model-a", changed, 4, 0, 10)
    assert b[0] == a[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    assert chain_keys(b"model-a", tokens, 4, 6, 10, prev=a[5]) == a[6:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_decodes_to_its_bits_and_any_damage_is_refused(dtype):
    block = {
        0: (torch.randn(4, 2, 8).to(dtype), torch.randn(4, 2, 8).to(dtype)),
        1: (torch.randn(4, 5),),
    }
    key = os.urandom(16)
    data = encode(key, block)
    back = decode(data, key)
    assert back.keys() == block.keys()
    assert all(
        torch.equal(x, y) and x.dtype == y.dtype for k in block for x, y in zip(block[k], back[k])
    )
    flipped = bytearray(data)
    flipped[random.randrange(len(data))] ^= 1 << random.randrange(8)
    for bad in (bytes(flipped), data[: random.randrange(len(data))], data + b"\0"):
        with pytest.raises(CorruptBlock):
            decode(bad, key)
    with pytest.raises(CorruptBlock, match="another block"):
        decode(data, os.urandom(16))


# ---- tiers in the engine ----


def test_blocks_evicted_from_a_small_pool_come_back_from_ram(tiny):
    ref, model, _ = tiny[3]
    a, b = prompt(60, seed=2), prompt(60, seed=3)
    eng = engine(model, kv_cache_tokens=96, prefix_cache_ram="1MB")  # 24 blocks: a or b, not both
    assert eng.generate([a], GREEDY) == [hf_greedy(ref, a)]
    assert eng.generate([b], GREEDY) == [hf_greedy(ref, b)]  # evicts a's blocks into RAM
    eng.prefix_cache.flush()
    before, hits = eng.metrics.prefill_tokens, eng.blocks.hit_tokens
    assert eng.generate([a], GREEDY) == [hf_greedy(ref, a)]
    assert eng.blocks.hit_tokens - hits == 56  # (60 - 1) // 4 blocks of 4: in the pool or RAM
    assert eng.metrics.prefill_tokens - before == 4
    assert eng.blocks.loaded_tokens == 4 * eng.prefix_cache.ram.stats.hits > 0
    eng.close()


def test_a_prompt_tail_of_one_token_counts_as_prefill(tiny):
    """A prompt whose blocks all hit but its last token: that token is prefill work (the metric
    had counted it as a decode token, so a replica reported no prefill for it)."""
    ref, model, _ = tiny[3]
    p = prompt(41, seed=6)  # 10 blocks of 4 and one token
    eng = engine(model, prefix_cache_ram="1MB")
    assert eng.generate([p], GREEDY) == [hf_greedy(ref, p)]
    m = eng.metrics
    assert (m.prefill_tokens, m.decode_tokens) == (41, GREEDY.max_tokens - 1)
    assert eng.generate([p], GREEDY) == [hf_greedy(ref, p)]
    assert eng.blocks.hit_tokens == 40
    assert (m.prefill_tokens, m.decode_tokens) == (42, 2 * (GREEDY.max_tokens - 1))
    eng.close()


def test_a_restarted_engine_serves_the_prefix_from_disk_with_the_entries_it_computed(
    tiny, tmp_path
):
    ref, model, _ = tiny[3]
    p = prompt(50, seed=4)
    first = engine(model, prefix_cache_dir=str(tmp_path))
    assert first.generate([p], GREEDY) == [hf_greedy(ref, p)]
    first.close()
    assert len(list(tmp_path.rglob("*.kvb"))) == (50 + GREEDY.max_tokens - 1) // 4
    again = engine(model, prefix_cache_dir=str(tmp_path))
    assert again.generate([p + [7, 8]], GREEDY) == [hf_greedy(ref, p + [7, 8])]
    assert again.blocks.loaded_tokens == 48 and again.metrics.prefill_tokens == 4
    fresh = engine(model, prefix_cache_ram="1MB")  # the same keys, computed here
    fresh.generate([p], SamplingParams(max_tokens=1))
    assert same_entries(fresh, again, chain_keys(again.blocks.seed, p, 4, 0, 12))
    again.close(), fresh.close()


def same_entries(a, b, keys) -> bool:
    """Whether engines `a` and `b` hold bit-equal entries, of equal dtypes, for blocks `keys`."""
    for key in keys:
        x, y = block_rows(a, key), block_rows(b, key)
        if x.keys() != y.keys() or not all(
            torch.equal(u, v) and u.dtype == v.dtype for k in x for u, v in zip(x[k], y[k])
        ):
            return False
    return True


def test_another_model_with_the_same_tokenizer_misses(tiny, tmp_path):
    (_, model_a, path_a), (ref_b, model_b, _) = tiny[3], tiny[4]
    p = prompt(40, seed=5)
    a = engine(model_a, prefix_cache_dir=str(tmp_path))
    a.generate([p], GREEDY)
    a.close()
    b = engine(model_b, prefix_cache_dir=str(tmp_path))
    assert b.generate([p], GREEDY) == [hf_greedy(ref_b, p)]
    assert b.blocks.loaded_tokens == 0 and b.prefix_cache.persistent[0].stats.misses == 1
    bf16 = load_model(path_a, dtype=torch.bfloat16, progress=False)  # A's weights, another dtype
    a16 = engine(bf16, prefix_cache_dir=str(tmp_path))
    a16.generate([p], GREEDY)
    assert a16.blocks.loaded_tokens == 0
    b.close(), a16.close()


def test_mla_compressed_entries_go_through_disk_in_their_dtype(tmp_path):
    build_tiny("deepseek_v2", tmp_path / "model", seed=5)
    model = load_model(tmp_path / "model", dtype=torch.bfloat16, progress=False)
    p = prompt(30, seed=6)
    first = engine(model, prefix_cache_dir=str(tmp_path / "kv"))
    want = first.generate([p], GREEDY)
    first.close()
    again = engine(model, prefix_cache_dir=str(tmp_path / "kv"))
    assert again.generate([p], GREEDY) == want and again.blocks.loaded_tokens == 28
    keys = chain_keys(again.blocks.seed, p, 4, 0, 7)
    assert {t.dtype for b in block_rows(again, keys[0]).values() for t in b} == {torch.bfloat16}
    fresh = engine(model, prefix_cache_ram="1MB")
    fresh.generate([p], SamplingParams(max_tokens=1))
    assert same_entries(fresh, again, keys)
    again.close(), fresh.close()


def test_corrupt_truncated_and_foreign_files_are_skipped_with_a_warning_naming_them(
    tiny, tmp_path, caplog
):
    ref, model, _ = tiny[3]
    p = prompt(50, seed=7)
    first = engine(model, prefix_cache_dir=str(tmp_path))
    first.generate([p], GREEDY)
    first.close()
    tier = first.prefix_cache.persistent[0]
    keys = chain_keys(first.blocks.seed, p, 4, 0, 12)
    corrupt, truncated = tier.path(keys[3]), tier.path(keys[6])
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x10
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    (tmp_path / "notes.txt").write_text("not a block")
    foreign = corrupt.parent / "stray.bin"
    foreign.write_bytes(b"\0" * 64)
    with caplog.at_level(logging.WARNING, "hybridmoe.prefix_cache"):
        again = engine(model, prefix_cache_dir=str(tmp_path))
        assert again.generate([p], GREEDY) == [hf_greedy(ref, p)]
    warned = caplog.text
    assert str(tmp_path / "notes.txt") in warned and str(foreign) in warned
    assert str(corrupt) in warned and "checksum" in warned
    assert again.blocks.loaded_tokens == 12  # blocks 0-2; 3 is refused and computed again
    again.close()
    decode(corrupt.read_bytes(), keys[3])  # the recomputed block replaced the corrupt file
    again = engine(model, prefix_cache_dir=str(tmp_path))  # block 3 was rewritten; 6 is bad
    assert again.generate([p], GREEDY) == [hf_greedy(ref, p)]
    assert again.blocks.loaded_tokens == 24 and str(truncated) in caplog.text
    again.close()


def test_the_disk_tier_keeps_to_its_size_and_rebuilds_its_index(tmp_path):
    data = {os.urandom(16): os.urandom(random.randrange(100, 1000)) for _ in range(40)}
    tier = DiskTier(tmp_path, capacity=8000)
    for key, value in data.items():
        tier.put(key, value)
    kept = [k for k in data if tier.path(k).exists()]
    assert tier.used == sum(len(data[k]) for k in kept) <= 8000
    assert kept == list(data)[-len(kept) :]  # the oldest went first
    again = DiskTier(tmp_path, capacity=8000)
    assert again.get_prefix(kept) == [data[k] for k in kept] and again.used == tier.used
    assert again.get_prefix([next(iter(data))]) == [] or kept[0] == next(iter(data))


def test_sizes_and_urls_are_checked(tiny):
    _, model, _ = tiny[3]
    for kw, flag in (
        ({"prefix_cache_ram": "lots"}, "--prefix-cache-ram"),
        ({"prefix_cache_disk": "1GB"}, "--prefix-cache-dir"),
        ({"prefix_cache_remote": "http://x"}, "mooncake://"),
    ):
        with pytest.raises(UserError, match=flag):
            engine(model, **kw)


# ---- a remote tier: shared, down, slow ----


@contextmanager
def remote_url(kind: str):
    """A shared store of `kind` started on 127.0.0.1, as a --prefix-cache-remote URL."""
    if kind == "redis":
        with redis_server() as (url, _):
            yield url
    else:
        with mooncake_store() as url:
            yield url


@pytest.mark.parametrize("kind, seed", [("redis", 8), ("mooncake", 9)])
def test_a_second_engine_loads_what_the_first_wrote_to_the_remote_store(tiny, kind, seed):
    ref, model, _ = tiny[3]
    p = prompt(60, seed=seed)
    with remote_url(kind) as url:
        a = engine(model, prefix_cache_remote=url)
        a.generate([p], GREEDY)
        a.close()
        b = engine(model, prefix_cache_remote=url)
        assert b.generate([p], GREEDY) == [hf_greedy(ref, p)]
        assert b.blocks.loaded_tokens == 56 and b.metrics.prefill_tokens == 4
        b.close()


def test_a_remote_tier_that_is_down_or_hung_makes_requests_compute(tiny):
    ref, model, _ = tiny[3]
    p = prompt(30, seed=10)
    for url in (
        f"redis://127.0.0.1:{free_port()}/0",
        f"mooncake://127.0.0.1:{free_port()}?metadata=http://127.0.0.1:{free_port()}/metadata",
    ):
        down = engine(model, prefix_cache_remote=url, prefix_cache_timeout=0.5)
        assert down.generate([p], GREEDY) == [hf_greedy(ref, p)]
        stats = down.prefix_cache.persistent[0].stats
        assert stats.errors + stats.timeouts >= 1 and down.blocks.loaded_tokens == 0
        down.close()
    with redis_server() as (url, proc):
        hung = engine(model, prefix_cache_remote=url, prefix_cache_timeout=0.3)
        os.kill(proc.pid, signal.SIGSTOP)  # a Redis that accepts and never answers
        try:
            assert hung.generate([p], GREEDY) == [hf_greedy(ref, p)]
            assert hung.prefix_cache.persistent[0].stats.timeouts >= 1
            assert hung.blocks.loaded_tokens == 0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        hung.close()


def test_serve_documents_every_prefix_cache_flag_and_refuses_a_bad_one_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("ram SIZE", "dir DIR", "disk SIZE", "remote URL", "timeout S"):
        assert f"--prefix-cache-{flag}" in text
    for args, named in (
        (["--prefix-cache-disk", "1GB"], "--prefix-cache-dir"),
        (["--prefix-cache-ram", "4 gigs"], "--prefix-cache-ram"),
        (["--prefix-cache-remote", "memcached://x:1"], "mooncake://"),
        (["--prefix-cache-timeout", "0"], "--prefix-cache-timeout"),
    ):
        out = hybridmoe("serve", *args, "--port", str(free_port()))
        assert out.returncode == 2 and named in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
