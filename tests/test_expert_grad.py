"""The routed experts' training Function (experts/run/expert_grad.py) against autograd over a plain
per-token loop with each expert's weight made dense (W + scaling B A), in fp32: the layer output and
the gradients of its input, routing weights and every LoRA factor, for each choice of adapted
matrices (both, gate_up alone, down alone, none), with expert group sizes that need several tiles
and padding."""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.cpu_pool import CPUExperts
from hybridmoe.experts.run.expert_grad import expert_layer
from hybridmoe.experts.run.lora import ExpertLoRA
from hybridmoe.experts.run.store import ExpertStore

T, H, II, E, K, R = 300, 64, 24, 4, 2, 4


def reference(store, x, ids, w, lora):
    """The layer's output [T, H] by autograd over each token's K experts one at a time."""
    out = []
    for t in range(T):
        y = torch.zeros(H)
        for k in range(K):
            e = int(ids[t, k])
            we = store.get(0, e)
            gu_w, d_w = we.gate_up, we.down
            if lora and lora.factors("gate_up"):
                gu_w = gu_w + lora.scaling * lora.gate_up_B[e] @ lora.gate_up_A[e]
            if lora and lora.factors("down"):
                d_w = d_w + lora.scaling * lora.down_B[e] @ lora.down_A[e]
            gate, up = (gu_w @ x[t]).chunk(2)
            y = y + w[t, k] * (d_w @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("matrices", [("gate_up", "down"), ("gate_up",), ("down",), ()])
@pytest.mark.parametrize("workers", [1, 2, "dense"])
def test_expert_layer_gradients_equal_autograd_over_dense_experts(matrices, workers):
    """workers: the grouped form on that many CPU workers, or the form over every expert."""
    dense = workers == "dense"
    workers = 1 if dense else workers
    g = torch.Generator().manual_seed(len(matrices) + 7 * workers + dense)
    store = ExpertStore(ExpertShape(H, II, E, K, (0,)), torch.float32)
    for e in range(E):
        store.put(0, e, *(torch.randn(s, generator=g) / 8 for s in [(II, H), (II, H), (H, II)]))
    lora = ExpertLoRA(E, H, II, R, 8.0, matrices=matrices) if matrices else None
    if lora:
        with torch.no_grad():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    # skewed routing: group sizes from a few rows to most of the tokens
    ids = torch.stack(
        [torch.multinomial(torch.tensor([8.0, 4, 1, 0.3]), K, generator=g) for _ in range(T)]
    )
    w = torch.rand(T, K, generator=g).requires_grad_()
    probe = torch.randn(T, H, generator=g)
    params = [x, w, *(lora.parameters() if lora else [])]

    got = expert_layer(CPUExperts(workers), store, 0, x, ids, w, lora, dense=dense)
    got_grads = torch.autograd.grad((got * probe).sum(), params)
    want = reference(store, x, ids, w, lora)
    want_grads = torch.autograd.grad((want * probe).sum(), params)

    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert float((a - b).norm() / b.norm()) <= 1e-4
