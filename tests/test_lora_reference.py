"""LoRA is correct by reference: on tiny random models of every MoE architecture, the loss and every
LoRA gradient equal those of transformers + peft on the same weights, adapter and batch; an adapter
saved here loads into peft and gives the same logits as hybridmoe with it."""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.layers import lora
from hybridmoe.layers.lora import RowAdapters
from hybridmoe.loader import load_model
from hybridmoe.loader.adapter import load_adapter
from hybridmoe.models import lora as model_lora
from hybridmoe.train.forward import Batch, loss_sum
from tests.adapters import every_group, peft_model, save_random_adapter
from tests.contiguous_kv import SequenceKV, forward_step
from tests.tiny import build_tiny

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"]
ARCHS = [*MOE, "llama"]  # and the dense base, whose MLPs are plain target modules

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_batch(vocab: int, seed: int) -> list[tuple[list[int], list[bool]]]:
    """Three sequences of different lengths, each learning about two thirds of its tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (n,), generator=g).tolist(), [j % 3 != 0 for j in range(n)])
        for n in (7, 12, 5)
    ]


def peft_loss(pm, examples) -> torch.Tensor:
    """The same summed-then-averaged loss, each sequence run on its own through transformers."""
    total, count = 0.0, 0
    for tokens, learn in examples:
        logits = pm(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, V]
        rows = [j - 1 for j in range(1, len(tokens)) if learn[j]]
        targets = torch.tensor([tokens[j] for j in range(1, len(tokens)) if learn[j]])
        total = total + F.cross_entropy(logits[rows], targets, reduction="sum")
        count += len(rows)
    return total / count


def peft_grads(pm) -> dict[str, torch.Tensor]:
    """peft's LoRA gradients by their name in the adapter file."""
    out = {}
    for name, p in pm.named_parameters():
        if "lora_" in name:
            out[name.replace(".default", "")] = p.grad
    return out


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, out)
    return request.param, out


def test_loss_and_every_lora_gradient_equal_peft(arch_dir, tmp_path):
    arch, path = arch_dir
    ours = load_model(path, progress=False)
    ours.requires_grad_(False)
    ours.train()
    targets, modules = save_random_adapter(ours, tmp_path, targets=every_group(ours))
    examples = random_batch(ours.vocab_size, seed=1)
    batch = Batch.of(examples)
    loss = loss_sum(ours, batch, "a") / batch.num_targets
    loss.backward()

    ref = build_tiny(arch, tmp_path / "ref")
    pm = peft_model(ref, tmp_path, trainable=True)
    pm.train()
    want = peft_loss(pm, examples)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item())

    grads = peft_grads(pm)
    stems = model_lora.peft_names(ours, targets)
    assert len(grads) == 2 * len(modules)  # peft made exactly the adapter we saved
    for key, module in modules.items():
        grad_a, grad_b = model_lora.to_peft(_grads_of(module), key)
        for suffix, got in (("lora_A", grad_a), ("lora_B", grad_b)):
            expected = grads[f"{stems[key]}.{suffix}.weight"]
            assert rel_err(got, expected) <= 1e-4, f"{key} {suffix}"


def _grads_of(module):
    """A copy of an adapter module holding its parameters' gradients in their place."""
    import copy

    twin = copy.deepcopy(module)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), module.parameters()):
            p.copy_(q.grad)
    return twin


def test_adapter_saved_here_gives_peft_the_same_logits(arch_dir, tmp_path):
    arch, path = arch_dir
    maker = load_model(path, progress=False)
    save_random_adapter(maker, tmp_path, targets=every_group(maker), seed=2)
    ours = load_model(path, progress=False)
    load_adapter(ours, tmp_path, "mine")  # what serve --lora and generate --lora do
    ids = torch.randint(0, ours.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()

    ref = build_tiny(arch, tmp_path / "ref")
    with torch.no_grad():
        base = ref(input_ids=torch.tensor([ids])).logits[0].float()
        want = peft_model(ref, tmp_path)(input_ids=torch.tensor([ids])).logits[0].float()
    assert rel_err(want, base) > 1e-2  # the adapter changes the output

    cache, got = SequenceKV(), []
    with lora.using(RowAdapters.all("mine", 12)):  # prefill 12 tokens, then decode one by one
        hidden = _prefill(ours, cache, ids[:12])
    got.append(hidden)
    for i in range(12, 20):
        with lora.using(RowAdapters.all("mine", 1)):
            got.append(forward_step(ours, cache, [ids[i]], i)[None])
    assert rel_err(torch.cat(got), want) <= 1e-4


@torch.inference_mode()
def _prefill(model, cache, ids):
    from tests.contiguous_kv import BatchKVContext

    hidden = model(torch.tensor(ids), torch.arange(len(ids)), BatchKVContext([cache], [len(ids)]))
    return model.logits(hidden)


def test_a_merged_model_gives_transformers_the_logits_of_peft_with_the_adapter(arch_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridmoe.train.merge import merge

    arch, path = arch_dir
    maker = load_model(path, progress=False)
    save_random_adapter(maker, tmp_path / "a", targets=every_group(maker), seed=4)
    merged = merge(path, tmp_path / "a", tmp_path / "merged")
    ids = torch.tensor([list(range(3, 23))])
    with torch.no_grad():
        want = peft_model(build_tiny(arch, tmp_path / "ref"), tmp_path / "a")(ids).logits[0]
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits[0]
    assert rel_err(got, want) <= 1e-4
