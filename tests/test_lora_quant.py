"""LoRA training through frozen weights kept in blocks (quantised at load): the loss and every LoRA
gradient equal those of the same model with every block dequantised to dense fp32 weights (the
dense path, which tests/test_lora_reference.py checks against transformers + peft).

With the integer kernels off, blocks are multiplied as their dequantised fp32 values, so both models
compute the same function and only the order of additions differs (the input gradient through the
blocks adds up one tile of rows at a time): 1e-4, as against peft.

With the kernels on, the forward rounds every activation row to int8 per block, as inference does:
that alone moves these models' logits by about 1% (0.85-1.4% measured on this batch), so the
gradients are those of a function about 1% away, and each is a product of several such quantities.
The bounds: the loss within 1e-3 relative (measured at most 2.2e-4), all LoRA gradients together
within 5e-2 (measured at most 2.3e-2), and each gradient pointing the same way, cosine >= 0.99
(measured at least 0.995; the router's small gradient, a difference of expert outputs, moves most,
up to 12.5% in norm)."""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.loader import load_model
from hybridmoe.models import lora as model_lora
from hybridmoe.quant.tensor import QTensor, dense
from hybridmoe.train.forward import Batch, loss_sum
from tests.adapters import every_group, random_adapter
from tests.test_lora_reference import random_batch, rel_err
from tests.tiny import build_tiny, build_wide_mixtral

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# (architecture, format): every matrix of these tiny models fills the format's blocks
CASES = [("qwen3_moe", "q8_0"), ("qwen2_moe", "q8_0"), ("wide_mixtral", "q4_k")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def quantised(request, tmp_path_factory):
    arch, fmt = request.param
    out = tmp_path_factory.mktemp(arch)
    build_wide_mixtral(out) if arch == "wide_mixtral" else build_tiny(arch, out)
    return out, fmt


def dequantised_twin(model, path):
    """The same model with every block dequantised: dense fp32 weights and experts."""
    twin = load_model(path, progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(getattr(module, "weight", None), QTensor):
                twin.get_submodule(name).weight.copy_(module.weight.dequantize())
    for key, w in model.runtime.store.records.items():
        twin.runtime.store.records[key] = ExpertWeights(dense(w.gate_up), dense(w.down))
    return twin


def loss_and_grads(model, examples):
    """The batch's mean loss and every LoRA gradient, with the same random adapter (seed 0)."""
    model.requires_grad_(False)
    model.train()
    _, modules = random_adapter(model, "a", every_group(model))
    batch = Batch.of(examples)
    loss = loss_sum(model, batch, "a") / batch.num_targets
    loss.backward()
    params = model_lora.parameters(modules)
    return loss.item(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("kernels", ["off", "avx512"])
def test_lora_gradients_through_blocks_equal_the_dequantised_models(
    quantised, kernels, monkeypatch
):
    path, fmt = quantised
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", kernels)
    model = load_model(path, progress=False, quant=fmt)
    store = model.runtime.store
    assert all(isinstance(w.gate_up, QTensor) for w in store.records.values())
    examples = random_batch(model.vocab_size, seed=1)
    want_loss, want = loss_and_grads(dequantised_twin(model, path), examples)
    loss, got = loss_and_grads(model, examples)
    assert all(isinstance(w.down, QTensor) for w in store.records.values())  # still blocks
    if kernels == "off" or not _kernels_run():
        assert abs(loss - want_loss) <= 1e-4 * abs(want_loss)
        assert max(rel_err(g, w) for g, w in zip(got, want)) <= 1e-4
    else:
        assert abs(loss - want_loss) <= 1e-3 * abs(want_loss)
        assert rel_err(_flat(got), _flat(want)) <= 5e-2
        assert (
            min(F.cosine_similarity(g.flatten(), w.flatten(), dim=0) for g, w in zip(got, want))
            >= 0.99
        )
    assert len(got) == len(want) and all(w.norm() > 0 for w in want)


def _flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def _kernels_run() -> bool:
    from hybridmoe.native import quant

    return quant.available()
