"""Parity with transformers is the definition of correct: same weights, same logits, same tokens."""

import pytest
import torch

from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
from tests.contiguous_kv import SequenceKV, forward_step
from tests.tiny import BUILDERS, build_tiny, hf_logits

ARCHS = sorted(BUILDERS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    ref = build_tiny(request.param, out)
    return ref, load_model(out, progress=False)


def test_prefill_and_16_decode_steps_match_transformers(pair):
    ref, ours = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (24,), generator=gen).tolist()
    expected = hf_logits(ref, ids)  # [24, V]: position i is prefill (i < 8) or decode step i - 8
    cache = SequenceKV()
    with torch.inference_mode():
        hidden = ours(torch.tensor(ids[:8]), torch.arange(8), _ctx(cache, 8))
        got = [ours.logits(hidden)]
        for i in range(8, 24):
            got.append(forward_step(ours, cache, [ids[i]], i)[None])
    got = torch.cat(got)
    assert rel_err(got, expected) <= 1e-4
    for i in range(24):
        assert rel_err(got[i], expected[i]) <= 1e-4, f"position {i}"


def test_32_greedy_tokens_match_transformers(pair):
    ref, ours = pair
    prompt = [3, 17, 42, 5, 9]
    want = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=32,
        do_sample=False,
        min_new_tokens=32,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    got = list(generate_ids(ours, prompt, SamplingParams(max_tokens=32, temperature=0)))
    assert got == want


def test_incremental_decoding_equals_full_recomputation(pair):
    _, ours = pair
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    full = forward_step(ours, SequenceKV(), ids, 0)
    cache = SequenceKV()
    forward_step(ours, cache, ids[:4], 0)
    forward_step(ours, cache, ids[4:7], 4)
    for i in range(7, 10):
        last = forward_step(ours, cache, [ids[i]], i)
    assert rel_err(last, full) <= 1e-5


def _ctx(cache, n):
    from tests.contiguous_kv import BatchKVContext

    return BatchKVContext([cache], [n])
