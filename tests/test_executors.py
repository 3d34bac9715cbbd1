"""Executors on their own: the CPU pool, and the emulated accelerator's slots, copies and clock."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.accelerators import EmulatedAccelerator, HostOnly, Staging
from hybridmoe.experts.run.cpu_pool import CPUPool
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.store import ExpertStore

SHAPE = ExpertShape(hidden=16, intermediate=8, num_experts=4, top_k=2, moe_layers=(0, 1))
COST = PROFILES["rtx4090-ddr5"].for_expert(SHAPE, "fp32")


def random_store(seed: int = 0) -> ExpertStore:
    g = torch.Generator().manual_seed(seed)
    store = ExpertStore(SHAPE, torch.float32)
    for layer in SHAPE.moe_layers:
        for e in range(SHAPE.num_experts):
            store.put(
                layer,
                e,
                torch.randn(8, 16, generator=g),
                torch.randn(8, 16, generator=g),
                torch.randn(16, 8, generator=g),
            )
    return store


def test_cpu_pool_returns_outputs_in_job_order():
    pool = CPUPool(workers=3)
    jobs = [lambda i=i: torch.full((2,), float(i)) for i in range(7)]
    outs, busy = pool.submit(jobs).result()
    assert [int(o[0]) for o in outs] == list(range(7)) and busy >= 0.0
    assert pool.submit([]).result() == ([], 0.0)
    pool.close()


def test_a_copy_is_a_real_copy_of_the_store_weights():
    store = random_store()
    acc = EmulatedAccelerator(store, slots=2, cost=COST)
    acc.begin_layer()
    acc.copy(1, 3, 0)
    w, slot = store.get(1, 3), acc.buffers.weights(0)
    assert torch.equal(slot.gate_up, w.gate_up) and torch.equal(slot.down, w.down)
    assert slot.gate_up.data_ptr() != w.gate_up.data_ptr()  # its own memory, not a view
    assert acc.buffers.holds[0] == (1, 3)


def test_gpu_expert_output_is_bit_identical_to_the_cpu():
    store = random_store()
    acc = EmulatedAccelerator(store, slots=1, cost=COST)
    x = torch.randn(5, 16)
    acc.begin_layer()
    acc.copy(0, 2, 0)
    (y,) = acc.gather([acc.run(x, 0, 2, 0)])
    assert torch.equal(y, expert_ffn(x, store.get(0, 2)))


def test_gpu_expert_waits_for_its_copy_event():
    acc = EmulatedAccelerator(random_store(), slots=2, cost=COST, keep_log=True)
    acc.begin_layer()
    acc.copy(0, 0, 0)
    acc.copy(0, 1, 1)  # queued behind the first on the copy stream
    acc.run(torch.randn(1, 16), 0, 1, 1)
    finish = acc.end_layer(0.0)
    run = acc.runs[0]
    assert run.ready == pytest.approx(2 * COST.t_copy())
    assert run.start == pytest.approx(run.ready)
    assert finish == pytest.approx(run.start + COST.t_gpu(1))
    acc.check()


def test_a_copy_waits_until_the_gpu_is_done_with_the_slot():
    acc = EmulatedAccelerator(random_store(), slots=1, cost=COST, keep_log=True)
    acc.begin_layer()
    acc.copy(0, 0, 0)
    acc.run(torch.randn(64, 16), 0, 0, 0)
    gpu_end = acc.runs[0].end
    acc.copy(1, 0, 0)  # evicts (0, 0) while it may still be computing
    assert acc.copies[1].start >= gpu_end
    acc.check()


def test_running_an_expert_from_a_slot_that_holds_another_is_refused():
    acc = EmulatedAccelerator(random_store(), slots=1, cost=COST)
    acc.begin_layer()
    acc.copy(0, 0, 0)
    with pytest.raises(RuntimeError, match="holds"):
        acc.run(torch.randn(1, 16), 0, 1, 0)


def test_staging_copies_are_not_kept_and_work_within_the_layer():
    store = random_store()
    acc = EmulatedAccelerator(store, slots=0, cost=COST, keep_log=True)
    acc.begin_layer()
    a, b = acc.copy(0, 1, None), acc.copy(0, 2, None)
    assert isinstance(a, Staging) and a != b
    x = torch.randn(3, 16)
    ya, yb = acc.gather([acc.run(x, 0, 1, a), acc.run(x, 0, 2, b)])
    assert torch.equal(ya, expert_ffn(x, store.get(0, 1))) and torch.equal(
        yb, expert_ffn(x, store.get(0, 2))
    )
    acc.end_layer(0.0)
    acc.begin_layer()
    assert acc.copy(1, 0, None) == a  # staging buffers are reused layer after layer
    acc.check()


def test_the_layer_ends_with_the_later_of_cpu_and_gpu():
    acc = EmulatedAccelerator(random_store(), slots=1, cost=COST)
    start = acc.begin_layer()
    assert acc.end_layer(0.5) == pytest.approx(start + 0.5)  # the CPU alone
    t = acc.begin_layer()
    acc.copy(0, 0, 0)
    acc.run(torch.randn(1, 16), 0, 0, 0)
    assert acc.end_layer(0.0) == pytest.approx(t + COST.t_copy() + COST.t_gpu(1))


def test_the_emulator_needs_gpu_constants_and_host_only_refuses_gpu_work():
    with pytest.raises(ValueError):
        EmulatedAccelerator(
            random_store(), 1, PROFILES["this-machine-2core"].for_expert(SHAPE, "fp32")
        )
    host = HostOnly()
    with pytest.raises(RuntimeError):
        host.copy(0, 0, 0)
    with pytest.raises(RuntimeError):
        host.run(torch.randn(1, 16), 0, 0, 0)
