"""Placement as designed, under the emulated accelerator: the dense model and its KV cache live on
the device, routed experts in host RAM; per layer only the CPU experts' rows cross the bus (one
batched copy each way), and the cost model charges exactly those rows; pinned memory does not grow
with the number of experts; experts in blocks travel and sit in the GPU cache as their bytes, and
the output stays the CPU runtime's to the bit."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.experts.plan.host_memory import pinned_bytes, staging_bytes
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.accelerators import CUDAAccelerator, EmulatedAccelerator
from hybridmoe.experts.run.expert_bytes import layout
from hybridmoe.experts.run.hybrid_runtime import HybridConfig, HybridRuntime
from hybridmoe.experts.run.store import ExpertStore
from hybridmoe.loader import load_model
from hybridmoe.quant.tensor import QTensor
from tests.tiny import tiny_models

PROMPT = [3, 17, 5, 42, 8, 11, 2, 29, 64, 7]
# Every test runs on the emulator here, and on CUDA where there is one (those skip without it):
# together they reach the CUDA-only statements (CUDAAccelerator, the stager thread, the pinned
# buffers, the dense model and KV pools in GPU memory, blocks dequantised on the GPU).
DEVICES = [
    "emulated",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
COST = PROFILES["this-machine-2core"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory)


def hybrid(path, quant=None, device="emulated", **options):
    config = HybridConfig(**{"device": device, "cpu_clock": "model", **options})
    return load_model(
        path,
        runtime_factory=lambda shape, dtype: HybridRuntime(shape, dtype, config, COST),
        progress=False,
        quant=quant,
    )


def dense_tensors(model):
    """Every tensor of the dense model: parameters, buffers and weights kept in blocks."""
    for module in model.modules():
        yield from (p for p in module.parameters(recurse=False))
        yield from (b for b in module.buffers(recurse=False))
        yield from (v.data for v in vars(module).values() if isinstance(v, QTensor))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])  # shared experts; MLA
def test_dense_model_and_kv_cache_on_the_device_routed_experts_in_host_ram(arch, device, tiny):
    model = hybrid(tiny(arch), device=device, policy="value", budget="0.25")
    acc = model.runtime.acc
    engine = LLMEngine(model, config=EngineConfig(kv_cache_tokens=256, block_size=16))
    engine.add_request(PROMPT, GREEDY)
    while engine.has_unfinished():
        engine.step()
    tensors = list(dense_tensors(model))
    assert tensors and all(acc.on_device(t) for t in tensors)
    pools = [p for pools in engine.runner.kv.pools.values() for p in pools]
    assert pools and all(acc.on_device(p) for p in pools)
    for w in model.runtime.store.records.values():  # routed experts: host RAM, never placed
        assert not acc.on_device(w.gate_up) and not acc.on_device(w.down)
        assert w.gate_up.device.type == "cpu" and not w.gate_up.is_pinned()
    assert model.device == acc.device
    reference = list(generate_ids(load_model(tiny(arch), progress=False), PROMPT, GREEDY))
    assert list(generate_ids(model, PROMPT, GREEDY)) == reference
    model.runtime.close()


class PlanSpy:
    """The runtime's own planner, with each plan it made kept (the planner still plans)."""

    def __init__(self, planner):
        self.planner, self.plans = planner, []
        self.real_plan, planner.plan = planner.plan, self.plan

    def plan(self, *args, **kwargs):
        p = self.real_plan(*args, **kwargs)
        self.plans.append(p)
        return p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", ["0", "0.25", "1.0"])
def test_only_the_cpu_experts_rows_cross_the_bus_and_the_cost_model_charges_them(
    budget, device, tiny
):
    model = hybrid(tiny("qwen3_moe"), device=device, policy="value", budget=budget)
    runtime = model.runtime
    spy, moved = PlanSpy(runtime.planner), runtime.acc.bus.moved
    list(generate_ids(model, PROMPT, GREEDY))  # a 10-token prefill, then decode steps
    expected, charged = [], 0.0
    for plan in spy.plans:
        rows = sum(r.n_tokens for r in plan.cpu)
        if rows:  # one copy up (each CPU expert's rows, or the layer's if fewer), one back
            expected += [("up", min(rows, plan.tokens)), ("back", rows)]
        charged += runtime.cost.t_act(rows, plan.tokens)
    assert moved == expected
    cost, h = runtime.cost, runtime.shape.hidden
    bytes_moved = sum(n for _, n in moved) * h * model.embed_tokens.weight.element_size()
    assert cost.act_bytes == model.embed_tokens.weight.element_size()
    assert charged == pytest.approx(bytes_moved / cost.bw_pcie + len(moved) * cost.c_act)
    if budget == "0":  # every expert on the CPU: every layer sends its tokens' rows
        assert [n for d, n in moved if d == "up"] == [p.tokens for p in spy.plans]
    runtime.close()


def store_of(num_experts: int) -> ExpertStore:
    shape = ExpertShape(
        hidden=64, intermediate=32, num_experts=num_experts, top_k=2, moe_layers=(0,)
    )
    store = ExpertStore(shape, torch.float32)
    g = torch.Generator().manual_seed(0)
    for e in range(num_experts):
        store.put(0, e, *(torch.randn(s, generator=g) for s in ((32, 64), (32, 64), (64, 32))))
    return store


def accelerator(device, store, slots):
    cost = PROFILES["rtx4090-ddr5"].for_expert(store.shape, "fp32")
    if device == "cuda":
        return CUDAAccelerator(store, slots, cost)
    return EmulatedAccelerator(store, slots, cost)


@pytest.mark.parametrize("device", DEVICES)
def test_pinned_buffers_do_not_grow_with_the_number_of_experts(device):
    seen = []
    for experts in (4, 64):
        store = store_of(experts)
        acc = accelerator(device, store, slots=2)
        for e in range(experts):  # every expert crosses the bus, some twice
            acc.begin_layer()
            acc.copy(0, e, None)
            acc.copy(0, (e * 7) % experts, e % 2)
            acc.run(torch.randn(3, 64, device=acc.device), 0, (e * 7) % experts, e % 2)
            acc.end_layer(0.0)
        x = torch.randn(5, 64, device=acc.device)
        back = acc.to_device([acc.to_host(x)])
        assert torch.equal(back, x) and back.device == x.device
        for slot in (0, 1):  # the slots hold the last copies' bytes
            held = acc.buffers.holds[slot]
            w = store.get(*held)
            assert torch.equal(acc.buffers.weights(slot).gate_up.cpu(), w.gate_up)
        seen.append((acc.bus.alloc.count, acc.bus.alloc.nbytes))
        expert = layout(store.get(0, 0)).nbytes
        ring = staging_bytes(expert, pin=device == "cuda")
        assert acc.bus.alloc.nbytes <= ring + 2 * pinned_bytes(x.numel() * 4)  # ring, up, back
    assert seen[0] == seen[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_experts_in_blocks_cross_and_sit_in_the_cache_as_their_bytes(quant, device, tiny):
    """The emulator runs GPU experts on the native kernels: the CPU runtime's bits. CUDA
    dequantises the blocks and multiplies in fp32 while the CPU kernels quantise activations to
    8 bits (llama.cpp's scheme), so there greedy tokens must agree on 3 of 4."""
    path = tiny("qwen3_moe")
    reference_model = load_model(path, progress=False, quant=quant)
    reference = list(generate_ids(reference_model, PROMPT, GREEDY))
    for policy, budget in (("value", "0.25"), ("static", "1.0"), ("lru", "0.25")):
        model = hybrid(path, quant=quant, device=device, policy=policy, budget=budget)
        runtime = model.runtime
        tokens = list(generate_ids(model, PROMPT, GREEDY))
        if device == "emulated":
            assert tokens == reference, (policy, budget)
        else:
            assert sum(a == b for a, b in zip(tokens, reference)) >= 0.75 * len(reference)
        assert runtime.stats.total["gpu_runs"] > 0
        store_bytes = max(w.nbytes() for w in runtime.store.records.values())
        buffers = runtime.acc.buffers
        assert buffers.memory.dtype == torch.uint8 and buffers.size < store_bytes + 64
        for key, slot in runtime.planner.cache.slot_of.items():
            held, stored = buffers.weights(slot), runtime.store.get(*key)
            assert isinstance(held.gate_up, QTensor) and held.gate_up.fmt == stored.gate_up.fmt
            assert torch.equal(held.gate_up.data.cpu(), stored.gate_up.data)
            assert torch.equal(held.down.data.cpu(), stored.down.data)
        runtime.close()
