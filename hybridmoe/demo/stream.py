"""The dense model's residual stream on the calibration text, through hybridmoe's own Llama
(transformers' model classes are the tests' reference, not our code's engine).

Sequences go in flat, one after another ([T, H], as the engine runs them), so no padding and no
attention mask: each sequence attends to itself only, through a KV context that hands every
sequence its own entries back.
"""

from __future__ import annotations

import torch

from hybridmoe.config import HFConfig
from hybridmoe.models.llama import LlamaForCausalLM


def dense_model(dense: dict, config: dict) -> LlamaForCausalLM:
    """hybridmoe's Llama on the dense weights (Hugging Face names), fp32 on the CPU."""
    with torch.device("meta"):  # no random init: every weight is loaded below
        model = LlamaForCausalLM(HFConfig(config), runtime=None)
    model = model.to(torch.float32).to_empty(device="cpu")
    model.load_weights(dense.items())
    return model.eval()


class WholeSequences:
    """A KVContext for one pass over whole sequences: nothing is cached between calls (each layer
    sees every sequence once, entire), so a sequence's history is just its own new entries."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = seq_lens

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        return list(zip(*(e.split(self.seq_lens) for e in entries)))


def real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a padded batch ids/mask [B, L] without their padding: B id tensors [n_b]."""
    return [row[m] for row, m in zip(ids, mask)]


@torch.no_grad()
def embed(model: LlamaForCausalLM, sequences: list[torch.Tensor]):
    """The first layer's input [T, H] for the sequences laid end to end, with the rotary tables
    (positions restart at 0 in each sequence) and the sequences' lengths."""
    seq_lens = [len(s) for s in sequences]
    positions = torch.cat([torch.arange(n) for n in seq_lens])  # [T]
    hidden = model.embed_tokens(torch.cat(sequences))  # [T, H]
    return hidden, model.rotary.cos_sin(positions), seq_lens


@torch.no_grad()
def attention_half(layer, hidden: torch.Tensor, cos_sin, seq_lens: list[int]):
    """A decoder layer up to its FFN: (residual after attention, FFN input), both [T, H]."""
    attn = layer.self_attn(layer.input_layernorm(hidden), cos_sin, WholeSequences(seq_lens))
    residual = hidden + attn
    return residual, layer.post_attention_layernorm(residual)
