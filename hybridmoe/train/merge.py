"""Merging a LoRA adapter into a model's weights for export (`hybridmoe finetune merge`).

Every targeted matrix W becomes W + scaling * B A, computed in fp32 and stored in the checkpoint's
own dtype: dense projections, routers, and routed experts alike, whether the checkpoint keeps its
experts one by one (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2) or fused (gate_up_proj,
down_proj). Shards keep their names, so the index stays valid; the other files (config, tokenizer,
chat template) are copied. The result is written beside `out` and renamed into place whole.

A GGUF file is refused: its quantised experts would have to be re-quantised after merging, which
loses what the adapter added; `hybridmoe serve --lora` runs the adapter beside them instead.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.shape import expert_shape
from hybridmoe.experts.run.runtime import CPURuntime
from hybridmoe.loader import safetensors_dir
from hybridmoe.loader.adapter import load_adapter
from hybridmoe.loader.load import model_config
from hybridmoe.models import model_class

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(gate_up_proj|down_proj)$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}


def merge(model_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    model_dir, out = Path(model_dir).expanduser(), Path(out).expanduser().resolve()
    cfg = model_config(model_dir)  # a missing or broken model is its own one-line error
    if model_dir.is_file():
        raise UserError(
            f"{model_dir}: merge writes Hugging Face directories, not GGUF files, whose weights "
            "are kept in blocks: re-quantising them after adding the adapter would round most "
            "of its change away. Run the file with --lora DIR (the blocks stay as they are), or "
            "merge into the Hugging Face checkpoint it was made from and `hybridmoe export` that"
        )
    if out.exists():
        raise UserError(f"--out {out} exists; remove it or choose another directory")
    shape = expert_shape(cfg)
    with torch.device("meta"):  # the structure only: names and targets, no weights
        model = model_class(cfg)(cfg, CPURuntime(shape) if shape else None)
    targets, _ = load_adapter(model, adapter_dir, "merge")
    deltas = _Deltas(model, targets)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(model_dir, tmp, deltas)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class _Deltas:
    """scaling * B A for each checkpoint tensor the adapter changes, by checkpoint name."""

    def __init__(self, model, targets):
        self.model = model
        self.dense = {}  # our parameter name -> adapter module
        self.experts = {}  # layer -> ExpertLoRA
        for t in targets:
            if t.is_experts:
                self.experts[t.module.layer] = t.module.adapters["merge"]
            elif t.group == "router":
                self.dense[f"{t.name}.weight"] = t.module.gate.adapters["merge"]
            else:
                self.dense[f"{t.name}.weight"] = t.module.adapters["merge"]

    @torch.no_grad()
    def of(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The delta of checkpoint tensor `name` (its shape), or None when unchanged."""
        m = _EXPERT.match(name)
        if m and int(m[1]) in self.experts:
            return self._expert(self.experts[int(m[1])], int(m[2]), m[3])
        m = _FUSED.match(name)
        if m and int(m[1]) in self.experts:
            lora, matrix = self.experts[int(m[1])], m[2].removesuffix("_proj")
            if lora.factors(matrix) is None:
                return None
            return torch.stack([lora.delta_weight(matrix, e) for e in range(tensor.shape[0])])
        param = self.model.checkpoint_name(name)
        module = self.dense.get(param) if param else None
        return None if module is None else module.delta_weight()

    @staticmethod
    def _expert(lora, expert: int, part: str) -> torch.Tensor | None:
        role = _ROLE.get(part, "down")
        matrix = "down" if role == "down" else "gate_up"
        if lora.factors(matrix) is None:
            return None
        delta = lora.delta_weight(matrix, expert)  # [2I, H] or [H, I]
        inter = delta.shape[0] // 2
        return {"gate": delta[:inter], "up": delta[inter:], "down": delta}[role]


def _write(model_dir: Path, out: Path, deltas: _Deltas) -> None:
    files = safetensors_dir.safetensors_files(model_dir)
    changed = 0
    bar = tqdm(files, desc="merging", unit="file", file=sys.stderr, leave=False)
    for path in bar:
        merged = {}
        for name, tensor in safetensors_dir.iter_tensors([path]):
            delta = deltas.of(name, tensor)
            if delta is not None:
                tensor = (tensor.float() + delta).to(tensor.dtype)
                changed += 1
            merged[name] = tensor.contiguous()
        save_file(merged, str(out / path.name), metadata={"format": "pt"})
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    print(f"hybridmoe: merged the adapter into {changed} checkpoint tensors", file=sys.stderr)
