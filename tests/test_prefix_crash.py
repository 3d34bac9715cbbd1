"""kill -9 of `hybridmoe serve` while it writes blocks to its cache directory, again and again, four
servers at a time on one directory, killed the moment a block file is being written: no block file
is ever partial or corrupt, every block on disk holds the entries a fresh engine computes for its
key, and a restarted engine serves from it the answers computed without a cache."""

import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.prefix_cache.codec import decode
from hybridmoe.engine.prefix_cache.disk_tier import SUFFIX
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
from tests.serve_process import ServeProcess

ROUNDS, AT_ONCE = 5, 4  # 20 kills
BLOCK, MAX_TOKENS = 16, 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def send_until_killed(server: ServeProcess, prompts: list[list[int]], refused: list) -> None:
    """Send `prompts` one after another until the server is gone; a non-200 answer is noted."""
    for p in prompts:
        try:
            server.complete(p, MAX_TOKENS, timeout=30)
        except httpx.HTTPError:
            return  # killed
        except AssertionError as e:
            refused.append(str(e))


def temporary_files(root: Path) -> set[str]:
    """The blocks' temporary files under root: each is there until its block is renamed into
    place, or for good where its writer was killed."""
    return {
        f.path for d in os.scandir(root) if d.is_dir() for f in os.scandir(d) if f.name[0] == "."
    }


def writing(root: Path, left: set[str]) -> bool:
    """Whether a block is being written, once a block is on disk (one to check afterwards; a kill
    at the first write of every round left none): a temporary file that a killed writer of an
    earlier round did not leave (those stay, and would have every later round killed before it
    wrote a block)."""
    blocks = any(f.suffix == SUFFIX and f.name[0] != "." for f in root.rglob("*"))
    return blocks and bool(temporary_files(root) - left)


def kill_while_writing(model, flags, root, prompts, rng, refused) -> bool:
    """Start AT_ONCE servers and send them prompts; kill -9 them all the moment a block is being
    written (or after a random while). Whether a write was seen in progress at the kill."""
    left = temporary_files(root)
    servers = [ServeProcess(model, *flags) for _ in range(AT_ONCE)]
    for s in servers:
        s.wait_ready()
    senders = [
        threading.Thread(target=send_until_killed, args=(s, rng.sample(prompts, 6), refused))
        for s in servers
    ]
    for t in senders:
        t.start()
    deadline = time.monotonic() + rng.uniform(0.5, 3.0)
    while not (mid_write := writing(root, left)) and time.monotonic() < deadline:
        time.sleep(0.001)  # leave the cores to the servers
    for s in servers:
        s.kill()
    for t, s in zip(senders, servers):
        t.join()
        s.log.unlink(missing_ok=True)
    return mid_write


def reference_blocks(model, prompts) -> tuple[dict, dict]:
    """What a fresh engine computes: each prompt's greedy tokens, and its blocks by key."""
    eng = LLMEngine(
        model, None, EngineConfig(block_size=BLOCK, prefix_cache_ram="1GB"), eos_ids=()
    )  # the RAM tier only gives its keys the namespace a server's have
    answers, blocks = {}, {}
    for p in prompts:
        answers[tuple(p)] = eng.generate([p], GREEDY)[0]
        for key, block in eng.blocks.by_key.items():
            blocks.setdefault(key, eng.runner.kv.read_block(block.id))
    eng.close()
    return answers, blocks


def test_kill_9_during_writes_never_leaves_a_block_that_is_served_wrong(tiny_chat_model, tmp_path):
    rng = random.Random()
    prompts = [
        [rng.randrange(100, 49000) for _ in range(rng.randrange(100, 400))] for _ in range(12)
    ]
    flags = ("--dtype", "float32", "--block-size", str(BLOCK))
    flags += ("--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk", "1MB")
    refused = []
    mid_write = [
        kill_while_writing(tiny_chat_model, flags, tmp_path, prompts, rng, refused)
        for _ in range(ROUNDS)
    ]
    assert ROUNDS * AT_ONCE >= 20 and sum(mid_write) >= 3  # 20 kills, most during a write
    assert not refused  # every request before a kill was answered

    model = load_model(tiny_chat_model, dtype=torch.float32, progress=False)
    answers, computed = reference_blocks(model, prompts)
    files = [f for f in tmp_path.rglob(f"*{SUFFIX}") if not f.name.startswith(".")]
    assert files, "the servers wrote nothing before they were killed"
    for f in files:
        key = bytes.fromhex(f.name[: -len(SUFFIX)])
        block = decode(f.read_bytes(), key)  # raises on a partial or corrupt file
        want = computed[key]  # a KeyError: a block no prompt makes
        for layer in want:
            for x, y in zip(want[layer], block[layer]):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)

    again = LLMEngine(
        model, None, EngineConfig(block_size=BLOCK, prefix_cache_dir=str(tmp_path)), eos_ids=()
    )
    for p in prompts:
        assert again.generate([p], GREEDY)[0] == answers[tuple(p)]
    assert again.blocks.loaded_tokens > 0
    assert again.prefix_cache.persistent[0].stats.errors == 0
    again.close()
