"""Temperature 0 is reproducible: in the default configuration (bf16 on the native kernels) the same
16 prompts give identical tokens alone, in a batch of 16, repeated with the prefix cache warm, and
with prefill in small chunks; and a token's MoE output is the same bits alone and among others.

On the demo model: a trained model's logits have close runners-up that a rounding difference
flips (with --deterministic off, 11 of these 16 prompts answered differently in a batch); a random
tiny model's margins hide the differences."""

import pytest
import torch

from hybridmoe import invariance, native
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.loader import load_model, load_tokenizer
from hybridmoe.server.app import create_app
from hybridmoe.server.async_engine import AsyncEngine
from tests.served_model import ServerThread

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not native.available(),
        reason="bf16 is the default dtype only where the native kernels run (AVX512-BF16)",
    ),
]

TOPICS = ["the sea", "a cat", "Paris", "rain", "music", "the moon", "a train", "coffee"]
TOPICS += ["winter", "a library", "bees", "the desert", "a bridge", "chess", "bread", "a storm"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(demo_model):
    tok = load_tokenizer(demo_model)
    model = load_model(demo_model, dtype=torch.bfloat16, progress=False)
    # two shared 16-token blocks of system prompt, then each prompt's own words: the prefix cache
    # has whole blocks to hit, and the rest is prefilled after them
    system = "You are a helpful assistant who answers in two short sentences, " * 3
    prompts = [
        tok.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": f"About {t}?"}]
        )
        for t in TOPICS
    ]
    return model, tok, prompts


def engine(loaded, **config) -> LLMEngine:
    model, tok, _ = loaded
    return LLMEngine(model, tok, EngineConfig(kv_cache_tokens=8192, **config))


def test_greedy_tokens_do_not_depend_on_batch_chunks_or_prefix_cache(loaded):
    prompts = loaded[2]
    alone = [engine(loaded).generate([p], GREEDY)[0] for p in prompts]
    batch = engine(loaded, max_batch_size=16).generate(prompts, GREEDY)
    warm = engine(loaded, max_batch_size=16)
    first = warm.generate(prompts, GREEDY)
    again = warm.generate(prompts, GREEDY)
    assert warm.blocks.hit_tokens > 0  # the repeat took its prefixes from the cache
    chunked = engine(loaded, max_batch_size=16, max_tokens_per_step=7).generate(prompts, GREEDY)
    overlapped = engine(loaded, max_batch_size=16, overlap_prefill=True).generate(prompts, GREEDY)
    assert batch == alone
    assert first == alone and again == alone
    assert chunked == alone
    assert overlapped == alone


def test_the_server_answers_the_same_alone_and_among_others(loaded):
    """Through HTTP, as users see it: one request alone, then the same among 15 others sent at
    once."""
    import asyncio

    import httpx

    model, tok, prompts = loaded
    config = EngineConfig(max_batch_size=16, kv_cache_tokens=8192, overlap_prefill=True)
    server_engine = LLMEngine(model, tok, config)

    def body(i):
        return {"model": "tiny", "prompt": prompts[i], "max_tokens": 10, "temperature": 0}

    with ServerThread(create_app(AsyncEngine(server_engine), tok, "tiny")) as server:

        async def all_at_once():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                rs = await asyncio.gather(
                    *(client.post("/v1/completions", json=body(i)) for i in range(16))
                )
                return [r.json()["choices"][0]["text"] for r in rs]

        alone = [
            httpx.post(server.url + "/v1/completions", json=body(i), timeout=60).json()
            for i in range(16)
        ]
        together = asyncio.run(all_at_once())
    assert together == [a["choices"][0]["text"] for a in alone]


def test_a_tokens_moe_output_is_the_same_bits_alone_and_in_a_batch(loaded):
    """The layer that sums K experts per token: one token (combine_token) and many
    (combine_grouped, both of its branches) add the same terms in the same order."""
    model = loaded[0]
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    torch.manual_seed(0)
    for rows in (2, 9, 40):
        x = torch.randn(rows, moe.gate.in_features).to(torch.bfloat16)  # [rows, H]
        with torch.inference_mode(), invariance.rows_alone():
            model.runtime.begin_step(rows, [])
            together = moe(x)  # [rows, H]
            model.runtime.begin_step(1, [])
            alone = moe(x[-1:])  # [1, H]
        assert torch.equal(together[-1:], alone), rows


def test_a_lone_tokens_experts_are_summed_as_a_batchs_are():
    """combine_token (one token) and combine_grouped (a batch, both of its branches) add the same
    fp32 terms in the same order: in fp32 (no rounding to hide it) the sums are equal bits."""
    from hybridmoe.experts.run.ffn import combine_grouped, combine_token, group_by_expert

    g = torch.Generator().manual_seed(0)
    for tokens in (3, 40):
        x = torch.zeros(tokens, 64)  # [T, H]: only its shape and dtype matter
        ids = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(tokens)])  # [T, K]
        weights = torch.rand(tokens, 8, generator=g)  # [T, K]
        ys = {e: torch.randn(tokens, 64, generator=g) for e in range(16)}  # expert -> [T, H]
        groups = group_by_expert(ids)
        batch = combine_grouped(x, groups, [ys[e][rows] for e, rows, _ in groups], weights)
        t = tokens - 1
        alone = combine_token(
            x[t:], [ys[e][t : t + 1] for e in ids[t].tolist()], weights[t:], ids[t:]
        )
        assert torch.equal(batch[t:], alone), tokens
