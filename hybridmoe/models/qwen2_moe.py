"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Llama attention with q/k/v biases, and an MoE block of
softmax top-k routed experts plus one shared expert scaled per token by
sigmoid(shared_expert_gate x)."""

from __future__ import annotations

import time

import torch
from torch import nn

from hybridmoe import native
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.linear import linear
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE, softmax_topk
from hybridmoe.models.base import CausalLM
from hybridmoe.native.huge_pages import arena


class SharedExpertMoE(SparseMoE):
    """Routed experts (through the runtime) + a gated dense shared expert,
    which stays with the model."""

    def __init__(self, shape, renormalize, layer, runtime, shared_intermediate: int):
        super().__init__(shape, renormalize, layer, runtime)
        self.shared_expert = GatedMLP(shape.hidden, shared_intermediate, keep=True)
        self.shared_expert_gate = nn.Linear(shape.hidden, 1, bias=False)
        self._rows_in: tuple | None = None  # _packed's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # [T, H]
        gate = linear(x, self.shared_expert_gate.weight)  # [T, 1]
        shared = self.shared_expert(x, scale=torch.sigmoid(gate))  # [T, H] times [T, 1]
        return routed + shared

    def first_weight(self) -> torch.Tensor | None:
        """_packed's weight, the first product of decoder_half, where it applies; else None."""
        packed = self._packed()
        return None if packed is None else packed[0]

    def decoder_half(
        self, x: torch.Tensor, h: torch.Tensor, row: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x + self(h) [1, H] for a decode step's one token in two native calls, the bits of
        forward and the decoder layer's residual sum, where they apply (_shared_path); else None.
        One product reads the router, the shared expert's gate and its gate and up rows (one
        weight, _packed; `row`, where the attention half's call made it: first_weight); torch
        chooses the experts as `choose` does; the second call runs them, the shared expert's down
        and every sum (native.shared_moe_token). That is ~20 torch and Python calls a layer fewer,
        and one weight streamed instead of four (docs/notes/2026-11-25-demo-decode-step.md)."""
        path = self._shared_path(x, h)
        if path is None:
            return None
        packed, down, (table, workers) = path
        e = self.num_experts
        if row is None:  # else the attention half's call made it (first_weight)
            row = native.linear(h, packed)  # [1, E + 1 + 2S]: router logits, gate logit, gate, up
        ids, weights = softmax_topk(row[:, :e], self.top_k, self.renormalize)  # [1, K] each
        t0 = time.perf_counter()
        out = native.shared_moe_token(
            table, ids, weights, h, self.inter, (row, e, down), x, workers
        )  # [1, H]
        self.decoded(h, ids, weights, time.perf_counter() - t0)
        return out

    def decode_fields(self, x: torch.Tensor) -> tuple[list[int], int] | None:
        """SparseMoE.decode_fields for this block: decoder_half's product (_packed's weight: the
        router's rows, the shared expert's gate and its gate and up rows) and its second call, where
        _shared_path applies; else None."""
        path = self._shared_path(x, x, rows=True)
        if path is None:
            return None
        packed, down, (table, workers) = path
        return self._loop_fields(packed, native.EXPERTS_SHARED, table, down), workers

    def _shared_path(self, x: torch.Tensor, h: torch.Tensor, rows: bool = False):
        """(_packed's weight, the shared expert's down weight, (the runtime's expert table,
        threads)) where decoder_half applies: SparseMoE's _token_path (with its `rows`) with plain
        bf16 experts, rows the native kernels take, and no adapter anywhere in the block (_packed);
        else None."""
        experts = self._token_path(x, h, rows)
        if experts is None or experts[2] or not (native.applies(x) and native.applies(h)):
            return None  # native.shared_moe_token takes plain bf16 experts and rows
        weights = self._packed()
        return None if weights is None else (*weights, experts[:2])

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the router's, the shared expert gate's and the shared expert's gate and up weights as
        one [E + 1 + 2S, H] bf16 tensor, the shared expert's down weight [H, S]) where the block's
        weights are plain bf16 tensors without adapters, else None. The tensor is made once: the
        four parameters become views of it, so that it takes no memory of its own and follows any
        change to them in place; it is made again if one is replaced. A row's product does not
        depend on the rows beside it (bf16.c block), so one product over it gives the four
        products' bits."""
        if self._rows_in is not None:
            modules, params, ptrs, adapters, packed = self._rows_in
            for m, p, ptr in zip(modules, params, ptrs):
                if m._parameters.get("weight") is not p or p.data_ptr() != ptr:
                    break
            else:
                return None if any(adapters) else (packed, params[-1])
        mlp = self.shared_expert
        modules = (self.gate, self.shared_expert_gate, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        params = tuple(m.weight for m in modules)
        if not native.weights_apply(*params):
            return None
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, as the parameters
            packed = arena().cat([p.data for p in params[:4]])  # [E + 1 + 2S, H]
            start = 0
            for p in params[:4]:
                p.data = packed[start : start + p.shape[0]]
                start += p.shape[0]
        # the dicts of adapters that apply here (layers/lora.py), changed in place by attach
        adapters = (self.adapters, self.gate.adapters)
        adapters += tuple(m.adapters for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        ptrs = [p.data_ptr() for p in params]
        self._rows_in = (modules, params, ptrs, adapters, packed)
        return None if any(adapters) else (packed, params[-1])


class Qwen2MoeForCausalLM(CausalLM):
    def attention(self, i: int) -> nn.Module:
        qkv_bias = bool(
            self.cfg.get("qkv_bias", default=True)
        )  # older configs lack the key: biases always
        return Attention(self.cfg, i, self.rotary, bias=qkv_bias, o_bias=False)

    def ffn(self, i: int) -> nn.Module:
        cfg = self.cfg
        if not self.is_moe(i):
            return GatedMLP(cfg.get("hidden_size"), cfg.get("intermediate_size"))
        renormalize = bool(cfg.get("norm_topk_prob", default=False))
        shared = cfg.get("shared_expert_intermediate_size", default=0)
        if shared:
            return SharedExpertMoE(self.shape, renormalize, i, self.runtime, shared)
        return SparseMoE(self.shape, renormalize, i, self.runtime)
