"""The CPU runtime on its worker threads gives what it gives inline;
worker errors reach the caller."""

import pytest
import torch

from hybridmoe import tuning
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.cpu_pool import CPUPool
from hybridmoe.experts.run.runtime import CPURuntime


def _runtime(seed: int) -> CPURuntime:
    gen = torch.Generator().manual_seed(seed)
    shape = ExpertShape(hidden=32, intermediate=16, num_experts=6, top_k=3, moe_layers=(0,))
    r = CPURuntime(shape, torch.float32)
    for e in range(shape.num_experts):
        r.store.put(
            0,
            e,
            torch.randn(16, 32, generator=gen),
            torch.randn(16, 32, generator=gen),
            torch.randn(32, 16, generator=gen),
        )
    r.finish_loading()
    return r


@pytest.mark.parametrize("tokens", [1, 7])
def test_workers_give_the_inline_result(tokens, monkeypatch):
    r = _runtime(tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 32, generator=gen)
    weights, ids = torch.rand(tokens, 6, generator=gen).softmax(-1).topk(3, dim=-1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        r.begin_step(tokens, [])
        inline = r.forward(0, x, ids, weights)
        torch.set_num_threads(2)
        monkeypatch.setattr(tuning, "WORKERS_MIN_BYTES", 0)  # tiny experts: force the workers
        r.begin_step(tokens, [])
        pooled = r.forward(0, x, ids, weights)
        assert r.cpu.pool is not None and r.cpu.pool.workers == 2
        assert torch.get_num_threads() == 2  # starting the workers left the caller's count alone
    finally:
        torch.set_num_threads(before)
        r.close()
    torch.testing.assert_close(pooled, inline, rtol=1e-6, atol=1e-6)


def test_a_worker_error_is_raised_in_the_caller():
    workers = CPUPool(2)
    try:
        with pytest.raises(ZeroDivisionError):
            workers.map(lambda i: 1 / i, [1, 0, 2])
        assert workers.map(lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]  # still usable afterwards
    finally:
        workers.close()
