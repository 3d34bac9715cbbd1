"""Routers: from router logits to (expert ids, weights) per token, and the MoE block around them."""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe import native
from hybridmoe.experts.run.expert_grad import TrainLoRA
from hybridmoe.experts.run.ffn import bf16_kernels_take
from hybridmoe.experts.run.lora import ExpertLoRA, RowLoRA
from hybridmoe.experts.run.runtime import mix_tokens
from hybridmoe.layers import lora
from hybridmoe.layers.held import held
from hybridmoe.layers.linear import linear
from hybridmoe.layers.lora import add_lora
from hybridmoe.native import rows


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> ids [T, k], weights [T, k] (fp32). Mixtral, Qwen-MoE, OLMoE. One native
    call (native/rows.h route_row: exp and sums in double, the same bits for a row whatever its
    batch) wherever it applies, every pass that records no gradient of the logits; else torch."""
    chosen = rows.softmax_topk(logits, k, renormalize)
    if chosen is not None:
        return chosen
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def limit_to_groups(
    choice: torch.Tensor, n_group: int, topk_group: int, group_score: str
) -> torch.Tensor:
    """Mask (to -inf) the experts outside each token's `topk_group` best groups of experts.

    choice: [T, E], the experts split into n_group consecutive groups. A group's score is its best
    expert ("max", DeepSeek-V2) or the sum of its best two ("top2", DeepSeek-V3).
    """
    if n_group <= 1 or topk_group >= n_group:
        return choice
    grouped = choice.view(choice.shape[0], n_group, -1)  # [T, G, E/G]
    if group_score == "max":
        scores = grouped.max(dim=-1).values  # [T, G]
    else:
        scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    keep_groups = torch.topk(scores, topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, keep_groups, True)  # [T, G]
    keep = keep[:, :, None].expand_as(grouped).reshape_as(choice)  # [T, E]
    return choice.masked_fill(~keep, float("-inf"))


def scale_weights(weights: torch.Tensor, renormalize: bool, scale: float) -> torch.Tensor:
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def softmax_group_topk(
    logits: torch.Tensor,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores, top-k within the best groups (group_limited_greedy; n_group 1 is
    plain greedy), weights optionally renormalised, then times routed_scaling_factor.

    logits: [T, E] (fp32) -> ids [T, k], weights [T, k].
    """
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    ids = torch.topk(
        limit_to_groups(probs, n_group, topk_group, "max"), k, dim=-1
    ).indices  # [T, k]
    return ids, scale_weights(probs.gather(1, ids), renormalize, scale)


def sigmoid_group_topk(
    logits: torch.Tensor,
    correction: torch.Tensor | None,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the load-balancing bias `correction` [E] shifts which experts
    are chosen (groups by their top-2 sum, then top-k) but not their weights.

    logits: [T, E] (fp32) -> ids [T, k], weights [T, k].
    """
    scores = torch.sigmoid(logits.float())  # [T, E]
    choice = scores if correction is None else scores + correction.float()  # [T, E]
    ids = torch.topk(
        limit_to_groups(choice, n_group, topk_group, "top2"), k, dim=-1
    ).indices  # [T, k]
    return ids, scale_weights(scores.gather(1, ids), renormalize, scale)


class SparseMoE(nn.Module):
    """Router -> top-k per token -> the expert runtime -> weighted sum.

    The routed experts' weights are not parameters of this module: the runtime holds them, so that
    it alone decides where each expert runs (CPU, GPU cache, GPU after a copy). Two router features
    serve the runtime: the next MoE block's router, applied to this layer's input, is handed to it
    as a hint (its predictor ranks the next layer's experts by it: the residual stream moves
    slowly), and a routing replay (--routing-trace) may choose the experts instead of this router.
    """

    def __init__(self, shape, renormalize: bool, layer: int, runtime):
        super().__init__()
        self.layer, self.top_k, self.renormalize = layer, shape.top_k, renormalize
        self.num_experts, self.inter = shape.num_experts, shape.intermediate
        self.gate = nn.Linear(shape.hidden, shape.num_experts, bias=False)
        self.gate.adapters = {}  # the router's LoRA adapters (layers/lora.py), frozen unless asked
        self.adapters: dict[str, ExpertLoRA] = {}  # the routed experts' LoRA, by adapter name
        self.runtime = runtime
        self.replay = None  # an object whose ids(layer) [T, K] replace the router's choice
        self._next: tuple[SparseMoE, ...] = ()  # the next MoE block (in a tuple: not a submodule)

    def link_next(self, block: SparseMoE) -> None:
        self._next = (block,)

    def look_ahead(self, x: torch.Tensor, h: int = 1) -> torch.Tensor | None:
        """The h-th next MoE block's router on x [T, H]: probabilities [T, E] (fp32), or None
        where fewer than h blocks follow."""
        block = self
        for _ in range(h):
            if not block._next:
                return None
            block = block._next[0]
        return block.router_probs(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits [T, E] for x [T, H], its LoRA adapters included."""
        # layers/linear.py's kernels, not nn.Linear's: the same for a row whatever its neighbours
        return add_lora(linear(x, self.gate.weight), x, self.gate.adapters)

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's own choice: ids [T, k], weights [T, k] (fp32)."""
        return softmax_topk(self.logits(x), self.top_k, self.renormalize)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts x [T, H] runs on: the router's choice, or the replayed trace's with this
        router's weights for them."""
        if self.replay is None:
            return self.choose(x)
        ids = self.replay.ids(self.layer).to(x.device)  # [T, K]
        return ids, self.weights_at(x, ids)

    def router_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> per-expert routing probability [T, E] (fp32): what ranks experts for
        top-k."""
        return F.softmax(self.logits(x), dim=-1, dtype=torch.float32)

    def weights_at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights [T, K] (fp32) this router gives experts `ids` [T, K] on x [T, H], whether or
        not it would choose them: a replayed model mixes experts as its own router would."""
        weights = self.router_probs(x).gather(1, ids)  # [T, K]
        return weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)  # [T, k], [T, k]
        hint = partial(self.look_ahead, x) if self._next else None  # computed if asked
        return self.runtime.forward(self.layer, x, ids, weights, hint, self.expert_lora(len(x)))

    def first_weight(self) -> torch.Tensor | None:
        """The weight of decoder_half's first product on h, the router's, where the attention half
        may make that product in its own native call (a plain bf16 weight the kernels take, no
        router adapter, no replay: `choose` is then softmax_topk of that product); else None."""
        gate = self._modules["gate"]  # a dict read (layers/held.py): every layer, every step
        w = held(gate, "weight")
        if gate.adapters or self.replay is not None or not native.weights_apply(w):
            return None
        return w

    def decoder_half(
        self, x: torch.Tensor, h: torch.Tensor, row: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x + self(h) [1, H] for a decode step's one token, the bits of forward and the decoder
        layer's residual sum, where the runtime lets the block run the token's experts
        (`token_experts`: every expert on the CPU) and nothing else changes what runs (_token_path);
        else None. The router's choice, then one native call for the experts and their weighted
        sum (mix_tokens): the runtime's layers of Python and torch calls, which after the previous
        call's weight stream run on emptied caches (~0.1 ms a layer), are skipped
        (docs/notes/2026-12-06-decode-step-glue.md). row: the router's logits [1, E] where the
        attention half made them (first_weight), else None."""
        experts = self._token_path(x, h)
        if experts is None:
            return None
        table, workers, blocks = experts
        if row is None:
            ids, weights = self.choose(h)  # [1, K] each
        else:  # choose's bits: the same product, no adapter
            ids, weights = softmax_topk(row, self.top_k, self.renormalize)
        t0 = time.perf_counter()
        out = mix_tokens(table, blocks, ids, weights, h, self.inter, workers)  # [1, H]
        if out is None:  # a row the kernels do not take: the modules' path
            return None
        self.decoded(h, ids, weights, time.perf_counter() - t0)
        return x + out

    def decode_fields(self, x: torch.Tensor) -> tuple[list[int], int] | None:
        """What native.decode_layers needs of this block for x [T, H], a decode step's tokens (one
        per sequence) whose attention halves it runs, where the block would run them with the same
        native calls (first_weight; _token_path, whose rules for several tokens the loop's calls
        follow; the experts' input is then bf16 rows on the CPU): (the router's and the experts'
        fields, bf16.c's from DL_ROUTER on, the experts' threads); else None. After the call,
        `decoded` tells the runtime."""
        router = self.first_weight()
        experts = None if router is None else self._token_path(x, x, rows=True)
        if experts is None or router.shape[0] != self.num_experts:
            return None
        table, workers, blocks = experts
        kind = native.EXPERTS_IN_BLOCKS if blocks else native.EXPERTS_BF16
        return self._loop_fields(router, kind, table), workers

    def _loop_fields(self, router, kind: int, table, down: torch.Tensor | None = None) -> list[int]:
        """bf16.c's fields from DL_ROUTER on: the first product's weight (the router's rows
        first) and its rows, the router's E, K and renormalisation, the experts' kind, table and
        intermediate size, and a shared expert's down weight [H, S] and S (0, 0 without one)."""
        fields = [router.data_ptr(), router.shape[0], self.num_experts, self.top_k]
        fields += [int(self.renormalize), kind, table.data_ptr(), self.inter]
        return fields + ([0, 0] if down is None else [down.data_ptr(), down.shape[1]])

    def decoded(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, seconds: float):
        """What forward tells the runtime, for tokens decoder_half or native.decode_layers ran
        through this block: h [T, H] their experts' input, ids and weights [T, K] the router's
        choice, seconds the experts' time."""
        hint = partial(self.look_ahead, h) if self._next else None  # as forward's
        self.runtime.ran_token(self.layer, ids, weights, seconds, hint)

    def _token_path(self, x: torch.Tensor, h: torch.Tensor, rows: bool = False):
        """The runtime's token_experts where decoder_half applies: one row on the CPU, contiguous,
        no gradients, the router's own choice, no adapter on the router or the experts; else None
        (which row dtypes the kernels take: mix_tokens). With `rows`, several rows too where the
        experts are in blocks (the runtime's one call for any count: quant_kernels.moe_tokens) or
        where mix_tokens gives plain bf16 experts' rows to the bf16 kernels (ffn.bf16_kernels_take:
        up to native.MAX_ROWS, any count where each row is computed as if alone). Checked on every
        layer of every step."""
        if (
            (x.shape[0] != 1 and not rows)
            or self.replay is not None
            or torch.is_grad_enabled()
            or self.adapters
            or self._modules["gate"].adapters
            or not h.is_cpu
            or not (h.is_contiguous() and x.is_contiguous())
        ):
            return None
        experts = self.runtime.token_experts(self.layer)
        if experts is not None and x.shape[0] != 1 and not (experts[2] or bf16_kernels_take(x)):
            return None  # plain bf16 experts: the rows mix_tokens gives the bf16 kernels
        return experts

    def expert_lora(self, num_rows: int) -> RowLoRA | TrainLoRA | None:
        """What the runtime is told of the pass's expert adapters: a training step's (in training
        mode, gradients on: the one adapter being trained, or none), which rows use which (serving),
        or None when no adapter of these experts applies."""
        rows = lora.current()
        if self.training and torch.is_grad_enabled():
            names = [name for name, _ in rows.groups()] if rows else []
            return TrainLoRA(self.adapters.get(names[0]) if names else None)
        if not lora.active(self.adapters):
            return None
        adapter = torch.full((num_rows,), -1, dtype=torch.long)  # [T]
        loras: list[ExpertLoRA] = []
        for name, index in rows.groups():
            if name in self.adapters:
                adapter[slice(None) if index is None else index] = len(loras)
                loras.append(self.adapters[name])
        return RowLoRA(adapter, loras)
