"""LoRA adapters on disk, in PEFT's format: a directory with adapter_config.json and
adapter_model.safetensors, loadable by transformers + peft (`PeftModel.from_pretrained`) onto the
same base model. Names and layouts are models/lora.py's.

    save_adapter(model, targets, modules, out, rank=8, alpha=16, base_model="my-model")
    targets = load_adapter(model, "DIR", name="my-adapter")   # attached to model under `name`
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save

from hybridmoe.errors import UserError
from hybridmoe.files import write_atomic
from hybridmoe.models import lora as model_lora
from hybridmoe.models.lora import Target

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_VERSION = "0.21.2"  # the peft release whose format this writes (and the tests check)


@dataclass
class AdapterConfig:
    rank: int
    alpha: float
    dropout: float
    base_model: str
    target_modules: list[str] | str
    target_parameters: list[str]


def save_adapter(
    model,
    targets: list[Target],
    modules: dict,
    out: str | Path,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    base_model: str = "",
) -> Path:
    """Write the adapter whose modules (models/lora.py attach) sit on `targets` into directory
    `out`, each file atomically (tensors first: a config never points at missing tensors)."""
    out = Path(out)
    names = model_lora.peft_names(model, targets)
    tensors = {}
    for key, module in modules.items():
        a, b = model_lora.to_peft(module, key)
        tensors[f"{names[key]}.lora_A.weight"] = a.detach().float().contiguous()
        tensors[f"{names[key]}.lora_B.weight"] = b.detach().float().contiguous()
    write_atomic(out / WEIGHTS, save(tensors, metadata={"format": "pt"}))
    target_modules, target_parameters = model_lora.peft_config_targets(model, targets)
    write_atomic(
        out / CONFIG,
        json.dumps(
            _peft_config(rank, alpha, dropout, base_model, target_modules, target_parameters),
            indent=2,
        ),
    )
    return out


def _peft_config(rank, alpha, dropout, base_model, target_modules, target_parameters) -> dict:
    """adapter_config.json as peft writes it for a plain LoRA (the fields it reads; the others
    keep their defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "peft_version": PEFT_VERSION,
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_modules or None,
        "target_parameters": target_parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def read_config(path: str | Path) -> AdapterConfig:
    """The adapter's settings; one line naming the problem for anything this loader cannot take."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise UserError(
            f"{path}: not a LoRA adapter directory (it needs {CONFIG} and {WEIGHTS}, as "
            "`hybridmoe finetune` and peft write them)"
        )
    try:
        raw = json.loads((path / CONFIG).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        cfg = AdapterConfig(
            int(raw["r"]),
            float(raw["lora_alpha"]),
            float(raw.get("lora_dropout") or 0.0),
            str(raw.get("base_model_name_or_path") or "an unnamed model"),
            raw.get("target_modules") or [],
            list(raw.get("target_parameters") or []),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path / CONFIG}: not a readable PEFT LoRA config ({e})") from None
    unsupported = [
        k
        for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "layers_to_transform")
        if raw.get(k)
    ] + ([] if raw.get("peft_type", "LORA") == "LORA" else ["peft_type"])
    if unsupported:
        raise UserError(
            f"{path / CONFIG}: {unsupported[0]}={raw[unsupported[0]]!r} is not supported; "
            "hybridmoe loads plain LoRA adapters"
        )
    return cfg


def _config_names(model, target: Target) -> list[str]:
    """The names a config may give `target` by: its module, or its parameter (either for dense
    projections, which peft may target both ways)."""
    modules, params = model_lora.peft_config_targets(model, [target])
    if target.group in ("attention", "shared", "mlp"):
        hf = model_lora.hf_name(model, target.name)
        return [hf, f"{hf}.weight"]
    return modules + params


def _named(entry_list: list[str] | str, names: list[str]) -> bool:
    """peft's matching: a regex string must match a name whole; a list entry must equal a name or
    end it after a dot."""
    if isinstance(entry_list, str):
        return any(re.fullmatch(entry_list, n) for n in names)
    return any(n == e or n.endswith(f".{e}") for e in entry_list for n in names)


def resolve_targets(model, cfg: AdapterConfig) -> list[Target]:
    """The model's targets that the config names."""
    chosen = []
    for t in model_lora.all_targets(model):
        names = _config_names(model, t)
        if _named(cfg.target_modules, names) or _named(cfg.target_parameters, names):
            chosen.append(t)
    return chosen


def load_adapter(model, path: str | Path, name: str) -> tuple[list[Target], AdapterConfig]:
    """Attach the adapter in directory `path` to `model` as `name`; refused, naming the adapter's
    base model, when its tensors do not fit this model."""
    path = Path(path)
    cfg = read_config(path)
    targets = resolve_targets(model, cfg)
    other = f"{path} was made for {cfg.base_model!r}, not this model"  # the one-line refusal
    if not targets:
        raise UserError(f"{other}: none of its targets is a projection of this model")
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path / WEIGHTS}: cannot be read ({e})") from None
    modules = model_lora.attach(targets, name, cfg.rank, cfg.alpha)
    stems = model_lora.peft_names(model, targets)
    try:
        for key, module in modules.items():
            a = tensors.pop(f"{stems[key]}.lora_A.weight")
            b = tensors.pop(f"{stems[key]}.lora_B.weight")
            model_lora.from_peft(module, key, a.float(), b.float())
    except (KeyError, ValueError) as e:
        model_lora.detach(model, name)
        raise UserError(f"{other}: {_why(e)}") from None
    if tensors:
        model_lora.detach(model, name)
        raise UserError(f"{other}: it has {next(iter(tensors))}, which this model lacks")
    return targets, cfg


def _why(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"it lacks {e.args[0]}"
    return str(e)
