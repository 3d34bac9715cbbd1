"""The batching engine: whatever the batch, the chunking, the cache hits or the preemptions, each
request gets the tokens it would get alone (transformers' greedy output is the reference)."""

import threading

import pytest
import torch

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
from hybridmoe.native.threads import kernel_threads
from tests.tiny import build_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["mixtral", "llama"])
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    ref = build_tiny(request.param, out, seed=3)
    return ref, load_model(out, progress=False)


def hf_greedy(ref, prompt, n):
    ref.generation_config.eos_token_id = None  # the engines here run without EOS too (eos_ids=())
    ids = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt) :].tolist()


def random_prompts(count, seed, lo=1, hi=40, vocab=96):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (count,), generator=g).tolist()
    # no id 0: transformers' generate takes it for padding (pad_token_id=0) and masks it out
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def engine(model, **kw):
    return LLMEngine(model, None, EngineConfig(**{"block_size": 4, **kw}), eos_ids=())


@pytest.fixture(params=[False, True], ids=["one-pass", "overlap-prefill"])
def overlap(request):
    """Every pass in one thread, or prefill passes on the engine's second thread beside decode."""
    return request.param


def test_batched_chunked_greedy_equals_transformers_one_by_one(pair, overlap):
    ref, model = pair
    prompts = random_prompts(6, seed=1)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    eng = engine(
        model, max_batch_size=4, max_tokens_per_step=24, overlap_prefill=overlap
    )  # chunked prompts
    assert eng.generate(prompts, GREEDY, max_steps=500) == want
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_repeated_system_prompt_is_not_recomputed_and_outputs_do_not_change(pair, overlap):
    ref, model = pair
    system = random_prompts(1, seed=2, lo=30, hi=31)[0]
    prompts = [system + tail for tail in ([5, 6], [7], [8, 9, 10])]
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    eng = engine(model, overlap_prefill=overlap)
    got = [eng.generate([prompts[0]], GREEDY)[0]]
    computed = eng.metrics.prefill_tokens
    got += eng.generate(prompts[1:], GREEDY)
    assert got == want
    # 30 system tokens = 7 full blocks of 4 found in the cache by each later request
    assert eng.metrics.prefill_tokens - computed == sum(len(p) - 28 for p in prompts[1:])
    assert eng.blocks.hit_tokens == 2 * 28


def test_preemption_under_a_tiny_kv_budget_completes_every_request_correctly(pair, overlap):
    ref, model = pair
    prompts = random_prompts(5, seed=4, lo=10, hi=30)
    want = [hf_greedy(ref, p, 20) for p in prompts]
    eng = engine(
        model, kv_cache_tokens=64, max_batch_size=5, max_tokens_per_step=64, overlap_prefill=overlap
    )
    got = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0), max_steps=2000)
    assert eng.scheduler.num_preemptions > 0
    assert got == want
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.has_unfinished()


def test_abort_frees_the_blocks_and_the_others_go_on(pair):
    ref, model = pair
    prompts = random_prompts(3, seed=5)
    eng = engine(model)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    outs = {}
    for o in eng.step():  # every prompt fits in one step: each has its first token
        outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert eng.abort(ids[1]) and not eng.abort(ids[1])
    del outs[ids[1]]
    for _ in range(100):
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        if not eng.has_unfinished():
            break
    assert set(outs) == {ids[0], ids[2]}
    assert outs[ids[2]] == hf_greedy(ref, prompts[2], GREEDY.max_tokens)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_seeded_sample_does_not_depend_on_the_batch(pair, overlap):
    _, model = pair
    prompts = random_prompts(4, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=123)
    alone = engine(model).generate([prompts[0]], params)[0]
    together = engine(model, max_tokens_per_step=16, overlap_prefill=overlap).generate(
        prompts, params
    )[0]
    assert alone == together


def test_logprobs_are_those_of_the_model(pair):
    ref, model = pair
    prompt = [3, 1, 4, 1, 5]
    eng = engine(model)
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    (out,) = eng.step()
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = torch.topk(want, 3)
    assert out.logprobs[0].logprob == pytest.approx(float(want.max()), abs=1e-4)
    assert [t for t, _ in out.logprobs[0].top] == top.indices.tolist()
    assert out.finished and out.finish_reason == "length"


def test_a_prompt_that_cannot_fit_is_refused_and_max_tokens_is_clipped_to_the_context(pair):
    _, model = pair
    eng = engine(model, kv_cache_tokens=32)
    with pytest.raises(ValueError, match="context"):
        eng.add_request(list(range(32)), GREEDY)
    eng.add_request(list(range(28)), SamplingParams(max_tokens=100, temperature=0))
    outs = [o for _ in range(20) for o in eng.step()]
    assert len(outs) == 4 and outs[-1].finish_reason == "length"


def test_prefill_chunks_run_on_prefill_threads_and_decode_steps_keep_the_callers(pair):
    ref, model = pair
    prompts = random_prompts(4, seed=5, lo=20, hi=40)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    eng = engine(
        model, max_batch_size=4, max_tokens_per_step=48, prefill_threads=2, threads_from_tokens=16
    )
    seen = []  # (new tokens, torch threads) of every forward pass
    forward = model.forward
    model.forward = lambda ids, *a, **kw: (
        seen.append((len(ids), torch.get_num_threads())) or forward(ids, *a, **kw)
    )
    try:
        got = eng.generate(prompts, GREEDY, max_steps=500)
    finally:
        del model.forward
    assert got == want
    assert {t for n, t in seen if n >= 16} == {2} and {t for n, t in seen if n < 16} == {1}
    assert torch.get_num_threads() == 1  # restored after each big step


class HeldPrefill:
    """Wraps model.forward while in a `with`: a prefill pass (more than one new token) with `hold`
    set waits until the test lets it go. With the passes in one thread that wait would never end
    (hence the timeout)."""

    def __init__(self, model):
        self.model, self.forward = model, model.forward
        self.hold, self.release, self.held = False, threading.Event(), threading.Event()
        self.threads = set()  # names of the threads that ran passes
        self.passes = []  # (thread name, new tokens, the kernels' threads) of every pass, in order
        model.forward = self

    def __call__(self, ids, *a, **kw):
        self.threads.add(threading.current_thread().name)
        self.passes.append((threading.current_thread().name, len(ids), kernel_threads()))
        if self.hold and len(ids) > 1:
            self.held.set()
            assert self.release.wait(timeout=30), "the prefill pass was never released"
        return self.forward(ids, *a, **kw)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.model.forward


def collect(outs, step_outputs):
    for o in step_outputs:
        outs.setdefault(o.request_id, []).extend(o.token_ids)


def run_to_end(eng, outs):
    for _ in range(100):
        collect(outs, eng.step())
        if not eng.has_unfinished():
            break


def decoding_and_held(eng, held, short, long, steps):
    """`short` decoding while `long`'s prefill pass is held on the prefill thread,
    after `steps` steps."""
    outs = {}
    a = eng.add_request(short, GREEDY)
    collect(outs, eng.step())  # short's prefill: with nothing to decode, on the engine's thread
    assert outs == {a: outs[a]} and len(outs[a]) == 1
    held.hold = True
    b = eng.add_request(long, GREEDY)
    for _ in range(steps):
        collect(outs, eng.step())
    assert held.held.wait(timeout=30)
    return outs, a, b


def test_decode_goes_on_while_a_prefill_pass_is_in_flight(pair):
    ref, model = pair
    short, long = random_prompts(2, seed=7, lo=8, hi=30)
    eng = engine(model, overlap_prefill=True)
    with HeldPrefill(model) as held:
        outs, a, b = decoding_and_held(eng, held, short, long, steps=5)
        assert b not in outs and len(outs[a]) == 6  # five decode steps while long's pass was held
        held.release.set()
        run_to_end(eng, outs)
    assert outs == {a: hf_greedy(ref, short, 12), b: hf_greedy(ref, long, 12)}
    assert held.threads == {threading.current_thread().name, "hybridmoe-prefill_0"}
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_request_aborted_while_its_prefill_is_in_flight_frees_its_blocks_after_the_pass(pair):
    ref, model = pair
    short, long = random_prompts(2, seed=8, lo=8, hi=30)
    eng = engine(model, overlap_prefill=True)
    with HeldPrefill(model) as held:
        outs, a, b = decoding_and_held(eng, held, short, long, steps=1)
        used = eng.blocks.num_used
        assert eng.abort(b) and not eng.abort(b)
        assert eng.blocks.num_used == used  # still being written by the pass in flight
        held.release.set()
        run_to_end(eng, outs)
    assert set(outs) == {a} and outs[a] == hf_greedy(ref, short, 12)
    assert eng.blocks.num_free == eng.blocks.num_blocks and eng.metrics.requests_aborted == 1


def test_beside_a_prefill_pass_decode_takes_one_thread_and_a_pass_alone_takes_them_all(pair):
    """overlap_prefill with torch at two threads: a prefill pass with nothing to decode runs on
    the engine's thread on both, a decode pass beside a prefill pass in flight on one (the prefill
    thread, on one, has the other core), a decode pass alone on both; each request still gets
    transformers' tokens."""
    ref, model = pair
    short, long = random_prompts(2, seed=9, lo=8, hi=30)
    torch.set_num_threads(2)
    try:
        eng = engine(model, overlap_prefill=True)
        with HeldPrefill(model) as held:
            outs, a, b = decoding_and_held(eng, held, short, long, steps=3)
            during = list(held.passes)
            held.release.set()
            # the pass done before the next step, so that short, 4 of 12 tokens in, still has
            # steps to take beside long (stepping at once, it could finish alone first)
            assert eng._in_flight.future.exception(timeout=30) is None
            run_to_end(eng, outs)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    me = threading.current_thread().name
    assert during[0] == (me, len(short), 2)  # short's prefill, alone
    assert {t for name, n, t in during[1:] if name == me} == {1}  # short decoding beside long's
    assert {t for name, n, t in held.passes if name != me} == {1}  # the prefill thread
    both = [t for name, n, t in held.passes if name == me and n == 2]  # both decoding, alone
    assert both and set(both) == {2}
    assert outs == {a: hf_greedy(ref, short, 12), b: hf_greedy(ref, long, 12)}


def test_overlap_prefill_is_refused_where_two_passes_cannot_run_at_once(pair, monkeypatch):
    """A model whose expert runtime keeps per-pass state (not reentrant: the hybrid runtime)."""
    _, model = pair
    monkeypatch.setattr(type(model), "reentrant", property(lambda self: False))
    with pytest.raises(ValueError, match="two forward passes at once"):
        engine(model, overlap_prefill=True)
