"""Which GGML type each tensor of an exported file gets, per output format, as llama.cpp chooses:

- gguf-bf16 and gguf-q8_0 as convert_hf_to_gguf.py --outtype bf16 / q8_0 writes them;
- gguf-q4_k_m as llama-quantize Q4_K_M makes it from such a file (llama-quant.cpp): Q4_K, with
  Q6_K for the output head (Q8_0 where its rows do not fill 256-blocks), for attn_v and the
  ffn_down tensors of the layers `use_more_bits` picks, and, for 8-expert models, Q8_0 attn_v and
  attn_k and Q5_K attn_output.

In every format, 1-D tensors, norms, biases and routers (ffn_gate_inp*) stay F32, and a matrix
whose rows do not fill whole blocks falls back as llama.cpp falls back: Q4_K -> Q5_0, Q5_K ->
Q5_1, Q6_K -> Q8_0, and to F16 when even 32-blocks do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

Q = gguf.GGMLQuantizationType
FORMATS = ("gguf-bf16", "gguf-q8_0", "gguf-q4_k_m")
FILE_TYPES = {
    "gguf-bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "gguf-q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "gguf-q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


@dataclass
class Mix:
    """The choice for one file: its format, and what llama-quantize counts over the whole model
    (layers, experts, attn_v tensors, whether the head is tied)."""

    fmt: str
    n_layer: int
    n_expert: int
    n_attn_v: int
    tied: bool
    i_attn_v: int = 0  # attn_v tensors seen so far, in file order

    def choose(self, name: str, shape: tuple[int, ...], layer: int | None) -> Q:
        if not _quantisable(name, shape):
            return Q.F32
        if self.fmt == "gguf-bf16":
            return Q.BF16
        target = Q.Q8_0 if self.fmt == "gguf-q8_0" else self._q4_k_m(name, shape, layer)
        return fallback(target, shape[-1])

    def _q4_k_m(self, name: str, shape: tuple[int, ...], layer: int | None) -> Q:
        if name == "output.weight" or (self.tied and name == "token_embd.weight"):
            return Q.Q6_K if shape[-1] % 256 == 0 else Q.Q8_0
        if "attn_v.weight" in name:
            more = use_more_bits(self.i_attn_v, self.n_attn_v)
            self.i_attn_v += 1
            return Q.Q8_0 if self.n_expert == 8 else Q.Q6_K if more else Q.Q4_K
        if "attn_k.weight" in name and self.n_expert == 8:
            return Q.Q8_0
        if "attn_output.weight" in name and self.n_expert == 8:
            return Q.Q5_K
        if "ffn_down" in name and layer is not None and use_more_bits(layer, self.n_layer):
            return Q.Q6_K
        return Q.Q4_K


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's pick of layers for more bits: the first and last eighth, and every third
    between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fallback(target: Q, cols: int) -> Q:
    """`target`, or what llama.cpp uses instead when rows of `cols` do not fill its blocks."""
    block = gguf.GGML_QUANT_SIZES[target][0]
    if cols % block == 0:
        return target
    target = _FALLBACK.get(target, target)
    return target if cols % gguf.GGML_QUANT_SIZES[target][0] == 0 else Q.F16


def _quantisable(name: str, shape: tuple[int, ...]) -> bool:
    """What convert_hf_to_gguf and llama-quantize both leave F32."""
    return (
        len(shape) >= 2
        and name.endswith(".weight")
        and not name.endswith("_norm.weight")
        and "ffn_gate_inp" not in name
    )


def mix(fmt: str, names: list[str], cfg: dict, n_expert: int) -> Mix:
    return Mix(
        fmt=fmt,
        n_layer=cfg["num_hidden_layers"],
        n_expert=n_expert,
        n_attn_v=sum("attn_v.weight" in n for n in names),
        tied="output.weight" not in names,
    )
