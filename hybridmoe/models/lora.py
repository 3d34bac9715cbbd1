"""LoRA adapters on a model: which projections they may target, attaching one, and the names and
layouts of its tensors in PEFT's files (adapter_model.safetensors).

Target groups (`--targets`): `attention` (every attention projection: q/k/v/o, MLA's q_a/q_b/
kv_a_proj_with_mqa/kv_b_proj), `experts` (every routed expert's gate/up and down), `shared` (shared
experts), `mlp` (the dense layers' MLPs), `router` (MoE routers); or single projections by name
(`q_proj`, `experts.down_proj`, ...).

PEFT's names are those of the transformers (>= 5) model: `model.layers.3.self_attn.q_proj` is a
`target_modules` entry, its tensors `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]. Routed experts are fused parameters there, targeted through
`target_parameters` (`model.layers.3.mlp.experts.gate_up_proj`, `...down_proj`); peft's
ParamWrapper keeps all experts' pairs in one A [E*r, in] (expert e's rows e*r..e*r+r-1) and one B
[out, r*E] (expert e's columns e, e+E, ...), and when both matrices of a layer are targeted it nests
the wrappers, gate_up's tensors under `experts.base_layer.`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from hybridmoe.errors import UserError
from hybridmoe.experts.run.lora import ExpertLoRA
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.lora import LoRA
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE

ATTENTION = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
GROUPS = ("attention", "experts", "shared", "mlp", "router")
DEFAULT_TARGETS = "attention,experts,shared"
PEFT_PREFIX = "base_model.model."
_SHARED = re.compile(r"\.shared_experts?\.")


@dataclass
class Target:
    """One adaptable part of the model: a dense projection, a router, or a layer's routed experts
    (one of their two matrices)."""

    name: str  # the module's name in the model: layers.3.self_attn.q_proj, layers.3.mlp (experts)
    group: str  # one of GROUPS
    key: str  # what --targets names it by: q_proj, gate_proj, experts.down_proj, router
    module: nn.Module  # the projection, the router's gate, or the MoE block
    shape: tuple[int, int]  # (in, out) of one matrix

    @property
    def matrix(self) -> str | None:
        """For routed experts, which matrix: "gate_up" or "down"."""
        return self.key.removeprefix("experts.").removesuffix("_proj") if self.is_experts else None

    @property
    def is_experts(self) -> bool:
        return self.group == "experts"


def all_targets(model) -> list[Target]:
    """Every part of `model` an adapter may target, in model order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            s = module.runtime.shape
            out.append(
                Target(f"{name}.gate", "router", "router", module, (s.hidden, s.num_experts))
            )
            for key, shape in (
                ("experts.gate_up_proj", (s.hidden, 2 * s.intermediate)),
                ("experts.down_proj", (s.intermediate, s.hidden)),
            ):
                out.append(Target(name, "experts", key, module, shape))
        elif isinstance(module, Linear):
            short = name.rsplit(".", 1)[-1]
            group = _group(model, name, short)
            if group is not None:
                out.append(
                    Target(name, group, short, module, (module.in_features, module.out_features))
                )
    return out


def _group(model, name: str, short: str) -> str | None:
    if ".self_attn." in name and short in ATTENTION:
        return "attention"
    if _SHARED.search(name):
        return "shared"
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    return "mlp" if isinstance(parent, GatedMLP) and name.count(".") == 3 else None


def select(model, targets: str | None = None) -> list[Target]:
    """The parts `targets` (a comma-separated list of groups and projection names) names; a name
    that matches nothing in this model is an error naming what does. None: DEFAULT_TARGETS, those
    of its groups the model has."""
    wanted = [t.strip() for t in (targets or DEFAULT_TARGETS).split(",") if t.strip()]
    found = all_targets(model)
    known = sorted({t.group for t in found} | {t.key for t in found})
    chosen = []
    for w in wanted:
        hits = [t for t in found if w in (t.group, t.key)]
        if not hits and targets is not None:
            raise UserError(
                f"--targets {w!r} names nothing in this model; it has {', '.join(known)}"
            )
        chosen += [t for t in hits if t not in chosen]
    if not chosen:
        raise UserError("--targets is empty; name at least one group or projection")
    return [t for t in found if t in chosen]  # model order


def check_rank(targets: list[Target], rank: int) -> None:
    """A rank above a target's smaller side adds nothing but parameters: refused."""
    if rank < 1:
        raise UserError(f"--lora-rank {rank}: give a positive rank")
    narrow = min(targets, key=lambda t: min(t.shape))
    if rank > min(narrow.shape):
        raise UserError(
            f"--lora-rank {rank} is larger than {narrow.name} {narrow.key} "
            f"({narrow.shape[0]} -> {narrow.shape[1]}); give at most {min(narrow.shape)} or leave "
            "that target out"
        )


def attach(
    targets: list[Target], name: str, rank: int, alpha: float, dropout: float = 0.0
) -> dict[str, nn.Module]:
    """Put a new, zero adapter `name` on every target (fp32, as PEFT keeps adapters); returns its
    modules by PEFT tensor-name stem (see peft_names)."""
    modules: dict[str, nn.Module] = {}
    for t in targets:
        if t.group == "router":
            m = t.module.gate.adapters.setdefault(name, LoRA(*t.shape, rank, alpha, dropout))
        elif t.is_experts:
            m = t.module.adapters.get(name)
            if m is None:
                s = t.module.runtime.shape
                matrices = tuple(u.matrix for u in targets if u.is_experts and u.name == t.name)
                m = ExpertLoRA(s.num_experts, s.hidden, s.intermediate, rank, alpha, matrices)
                t.module.adapters[name] = m
        else:
            m = t.module.adapters.setdefault(name, LoRA(*t.shape, rank, alpha, dropout))
        modules[t.name if not t.is_experts else f"{t.name}:{t.matrix}"] = m
    return modules


def adapter_dicts(model):
    """Every dict of adapters in `model`: its projections', routers' and MoE blocks' (each made
    with its module, and changed in place)."""
    for m in model.modules():
        if isinstance(m, Linear):
            yield m.adapters
        elif isinstance(m, SparseMoE):
            yield m.adapters
            yield m.gate.adapters


def adapter_names(model) -> frozenset[str]:
    """The adapters attached to `model`, by name."""
    return frozenset(name for holder in adapter_dicts(model) for name in holder)


def detach(model, name: str) -> None:
    """Remove adapter `name` from every part of `model`."""
    for holder in adapter_dicts(model):
        holder.pop(name, None)


def parameters(modules: dict[str, nn.Module]) -> list[nn.Parameter]:
    """The trainable tensors of an adapter's modules, each once."""
    seen, out = set(), []
    for m in modules.values():
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def hf_name(model, name: str) -> str:
    """Our module name -> the transformers (>= 5) model's: `model.` in front, and the feed-forward
    called `mlp` (Mixtral's checkpoints say block_sparse_moe; its module is mlp)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[2] == model.ffn_name:
        parts[2] = "mlp"
    return "model." + ".".join(parts)


def peft_config_targets(model, targets: list[Target]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of adapter_config.json: full transformers names.

    In an MoE model, the MLP projections (shared experts, dense layers) are named by their weight in
    target_parameters, not as modules: peft (0.21) reads a target module whose name ends in
    gate_proj/up_proj/down_proj (Mixtral: w1/w3/w2) as a transformers-4 expert and retargets it to
    the fused experts. As parameters they get the same tensors under the same names."""
    modules, params = [], []
    for t in targets:
        if t.group == "router":
            params.append(f"{hf_name(model, t.name.removesuffix('.gate'))}.gate.weight")
        elif t.is_experts:
            params.append(f"{hf_name(model, t.name)}.{t.key}")
        elif t.group in ("shared", "mlp") and model.runtime is not None:
            params.append(f"{hf_name(model, t.name)}.weight")
        else:
            modules.append(hf_name(model, t.name))
    return modules, params


def dropout_allowed(model, targets: list[Target]) -> bool:
    """Whether PEFT can express dropout for these targets: its LoRA on parameters (routed experts,
    routers, MoE models' MLPs: peft_config_targets) has none."""
    return not peft_config_targets(model, targets)[1]


def peft_names(model, targets: list[Target]) -> dict[str, str]:
    """attach()'s module keys -> the stem of their tensors' names in adapter_model.safetensors
    (`lora_A.weight` and `lora_B.weight` follow)."""
    out = {}
    for t in targets:
        if t.group == "router":
            out[t.name] = f"{PEFT_PREFIX}{hf_name(model, t.name.removesuffix('.gate'))}.gate"
        elif t.is_experts:
            both = sum(u.is_experts and u.name == t.name for u in targets) == 2
            nested = ".base_layer" if both and t.matrix == "gate_up" else ""
            out[f"{t.name}:{t.matrix}"] = f"{PEFT_PREFIX}{hf_name(model, t.name)}.experts{nested}"
        else:
            out[t.name] = PEFT_PREFIX + hf_name(model, t.name)
    return out


def to_peft(module: nn.Module, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A.weight, lora_B.weight) of one target in PEFT's layout."""
    if isinstance(module, ExpertLoRA):
        a, b = module.factors(key.rsplit(":", 1)[1])  # [E, r, in], [E, out, r]
        E, out, r = b.shape
        return a.reshape(E * r, -1), b.permute(1, 2, 0).reshape(out, r * E)
    return module.lora_A, module.lora_B


def from_peft(module: nn.Module, key: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Copy PEFT's (lora_A.weight, lora_B.weight) into one target's adapter."""
    want = tuple(tuple(t.shape) for t in to_peft(module, key))
    if (tuple(a.shape), tuple(b.shape)) != want:
        raise ValueError(f"shapes {tuple(a.shape)}, {tuple(b.shape)} where this model has {want}")
    with torch.no_grad():
        if isinstance(module, ExpertLoRA):
            fa, fb = module.factors(key.rsplit(":", 1)[1])
            E, out, r = fb.shape
            fa.copy_(a.reshape(E, r, -1))
            fb.copy_(b.reshape(out, r, E).permute(2, 0, 1))
        else:
            module.lora_A.copy_(a)
            module.lora_B.copy_(b)
