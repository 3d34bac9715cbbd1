"""Hugging Face tensors -> the tensors of a llama.cpp GGUF file: names (gguf's TensorNameMap),
routed experts stacked [E, rows, cols] per layer and role, Llama's q/k rows interleaved for GPT-J
rope, DeepSeek's kv_b_proj split into k_b (transposed) and v_b, a tied head written out where
llama.cpp needs one. Nothing is read here: each planned tensor says how to read its parts, so the
writer streams them one at a time (loader/gguf_names.py is the way back)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from hybridmoe.errors import UserError
from hybridmoe.export.gguf_metadata import NEEDS_OUTPUT

_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class Planned:
    """One GGUF tensor: its name, torch-order shape, and its parts in order (one expert each for
    a stack, else one), each a function that reads it as a tensor."""

    name: str
    shape: tuple[int, ...]
    parts: list[Callable[[], torch.Tensor]]

    @property
    def layer(self) -> int | None:
        m = _LAYER.match(self.name)
        return int(m[1]) if m else None


def plan(
    shapes: dict[str, tuple[int, ...]], read, cfg: dict, arch: gguf.MODEL_ARCH
) -> list[Planned]:
    """The GGUF tensors of a checkpoint with tensors `shapes` (HF name -> shape) that `read(name)`
    returns, in llama.cpp's order: token_embd, the layers in order, output_norm, output."""
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)  # dense MLP layers

    def gguf_name(hf: str) -> str:
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        found = names.get_name(hf, try_suffixes=(".weight", ".bias")) or dense.get_name(
            hf, try_suffixes=(".weight", ".bias")
        )
        if found is None:
            raise UserError(f"tensor {hf}: llama.cpp has no name for it in {arch.name.lower()}")
        return found

    out, experts = [], {}
    for hf, shape in shapes.items():
        if m := _EXPERT.match(hf):
            experts.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = hf
        elif hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        else:
            out.extend(_dense(hf, tuple(shape), read, cfg, arch, gguf_name))
    for (layer, block, role), per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        name = gguf_name(f"model.layers.{layer}.{block}.experts.{role}.weight")
        parts = [lambda hf=hf: read(hf) for hf in order]
        out.append(Planned(name, (len(order), *shapes[order[0]]), parts))
    if (
        cfg.get("tie_word_embeddings")
        and arch in NEEDS_OUTPUT
        and "model.embed_tokens.weight" in shapes
    ):
        embed = tuple(shapes["model.embed_tokens.weight"])
        out.append(Planned("output.weight", embed, [lambda: read("model.embed_tokens.weight")]))
    return sorted(out, key=_order)


def _order(t: Planned) -> tuple:
    top = {"token_embd.weight": -1, "output_norm.weight": 1 << 30, "output.weight": 1 << 31}
    return (t.layer if t.layer is not None else top.get(t.name, 1 << 29), t.name)


def _dense(hf: str, shape: tuple, read, cfg: dict, arch, gguf_name) -> list[Planned]:
    """A tensor that is not a routed expert, with llama.cpp's layout changes."""
    if hf.endswith("kv_b_proj.weight"):
        return _split_kv_b(hf, read, cfg, gguf_name)
    if arch == gguf.MODEL_ARCH.LLAMA and re.search(r"\.(q|k)_proj\.(weight|bias)$", hf):
        heads = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
        return [Planned(gguf_name(hf), shape, [lambda: permute_rows(read(hf), heads)])]
    if hf.endswith("shared_expert_gate.weight"):  # HF [1, H]; llama.cpp declares it [H]
        return [Planned(gguf_name(hf), shape[-1:], [lambda: _defined_gate(read(hf).reshape(-1))])]
    return [Planned(gguf_name(hf), shape, [lambda: read(hf)])]


# llama.cpp's qwen2moe computes the shared expert's gate sigmoid(x) as silu(x) / x, which is 0/0 =
# NaN for an all-zero gate row (the demo model's: its sigmoid is exactly 1/2, so x is always 0).
# Such a row is written as this constant instead: sigmoid moves by ~TINY * |sum(h)| / 4, under 1e-6
# for any activation a bf16 model holds, and x is no longer 0.
TINY_GATE = 2.0**-24


def _defined_gate(w: torch.Tensor) -> torch.Tensor:
    return torch.full_like(w, TINY_GATE) if not w.any() else w


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Per head, rows (2, D/2) -> (D/2, 2): the interleaved pairs of GPT-J rope that llama.cpp's
    llama uses."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _split_kv_b(hf: str, read, cfg: dict, gguf_name) -> list[Planned]:
    """kv_b_proj [H*(nope+v), rank] -> k_b [H, rank, nope] and v_b [H, v, rank], as newer
    converters write for MLA's absorbed form."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    rank = cfg["kv_lora_rank"]

    def halves():
        return read(hf).view(heads, nope + v, rank).split([nope, v], dim=1)

    return [
        Planned(
            gguf_name(hf.replace("kv_b_proj", "k_b_proj")),
            (heads, rank, nope),
            [lambda: halves()[0].transpose(1, 2).contiguous()],
        ),
        Planned(
            gguf_name(hf.replace("kv_b_proj", "v_b_proj")),
            (heads, v, rank),
            [lambda: halves()[1].contiguous()],
        ),
    ]
