"""What every model file shares: building the decoder stack, its forward, logits, and streaming
weight loading. A model file says what differs: its feed-forward (`ffn(i)`: a dense MLP or an MoE
block), its attention (`attention(i)`), its rotary embedding and checkpoint names."""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn

from hybridmoe import invariance, native
from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError
from hybridmoe.experts.plan.shape import expert_shape
from hybridmoe.experts.run.runtime import ExpertRuntime
from hybridmoe.layers.attention import Attention, tables_made
from hybridmoe.layers.decoder import DecoderLayer
from hybridmoe.layers.embedding import Embedding
from hybridmoe.layers.linear import Linear, linear
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.native import quant as quant_kernels
from hybridmoe.native.huge_pages import arena
from hybridmoe.native.threads import kernel_threads
from hybridmoe.quant.formats import FORMATS, suits
from hybridmoe.quant.tensor import QTensor, for_kernels

# One routed expert's matrix, per-expert layout: model.layers.3.mlp.experts.7.gate_proj.weight
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
# All experts of a layer stacked (transformers >= 5 in memory):
# model.layers.3.mlp.experts.gate_up_proj
_FUSED = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$"
)
_ROLE = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
}


class CausalLM(nn.Module):
    """A decoder-only LM: embed -> layers -> norm -> lm_head."""

    quant: str | None = None  # the block format dense weights are quantised to at load (--quant)
    ffn_name = "mlp"  # the feed-forward's name in checkpoints
    qk_norm: str | None = None  # Attention's q/k norms: None, "head" (Qwen3) or "full" (OLMoE)

    def __init__(self, cfg: HFConfig, runtime: ExpertRuntime | None = None):
        super().__init__()
        self.cfg = cfg
        self.runtime = runtime
        self.shape = expert_shape(cfg)
        self.device = torch.device("cpu")  # where the dense model lives (`place`)
        hidden, eps = cfg.get("hidden_size"), cfg.get("rms_norm_eps", default=1e-6)
        self.vocab_size = cfg.get("vocab_size")
        self.embed_tokens = Embedding(self.vocab_size, hidden)
        self.rotary = Rotary(self.rotary_dim(cfg), rope_parameters(cfg))
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, eps, self.attention(i), self.ffn(i), self.ffn_name)
            for i in range(cfg.get("num_hidden_layers"))
        )
        self.norm = RMSNorm(hidden, eps)
        self.tied = bool(cfg.get("tie_word_embeddings", default=False))
        self.lm_head = None if self.tied else Linear(hidden, self.vocab_size, bias=False)
        # _decode_layers' plans by (first layer, rows): (the key it was made under (_plan_key),
        # the count of attention tables made then, the plan)
        self._plans: dict[tuple[int, int], tuple] = {}
        self._version = 0  # counts the changes that a plan's key cannot see (_changed)
        self._adapter_dicts: list[dict] | None = None  # every dict of LoRA adapters, once found
        blocks = self.moe_blocks()
        for block, after in zip(blocks, blocks[1:]):
            block.link_next(after)

    # ---- what a model file says -----
    @staticmethod
    def rotary_dim(cfg: HFConfig) -> int:
        return cfg.head_dim()

    def attention(self, i: int) -> nn.Module:
        return Attention(self.cfg, i, self.rotary, qk_norm=self.qk_norm)

    def ffn(self, i: int) -> nn.Module:
        """Decoder layer i's feed-forward: a dense MLP or an MoE block (self.shape.moe_layers)."""
        raise NotImplementedError

    def is_moe(self, i: int) -> bool:
        return self.shape is not None and i in self.shape.moe_layers

    def moe_blocks(self) -> list[SparseMoE]:
        """The MoE blocks in layer order."""
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def replay_routing(self, replay) -> None:
        """Route every MoE block by a trace (experts/run/observers.py RoutingReplay), which the
        runtime tells where each step begins."""
        for block in self.moe_blocks():
            block.replay = replay
        self.runtime.add_observer(replay)
        self._changed()

    def _changed(self) -> None:
        """The weights, the routing or the mode changed: every decode plan is made again."""
        self._version += 1

    def train(self, mode: bool = True):
        self._changed()
        return super().train(mode)

    # ---- forward ----
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx,
        decode_rows: list[tuple[int, str]] = (),
    ) -> torch.Tensor:
        """input_ids, positions: [T] (sequences one after another, as ctx.seq_lens says) -> hidden
        [T, H].

        One call is one step of the expert runtime: it is told so here, with `decode_rows`, the
        (row, request id) of the pass's decode tokens, which only the engine knows (routing traces
        record each request's tokens under its id)."""
        if self.runtime is not None:
            self.runtime.begin_step(len(input_ids), list(decode_rows))
        input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        x = self.embed_tokens(input_ids)  # [T, H]
        cos_sin = self.rotary.cos_sin(positions)
        layers = self.layers
        if not self._decode_pass(x, ctx):
            for layer in layers:
                x = layer(x, cos_sin, ctx)
            return self.norm(x)
        i = 0
        while i < len(layers):
            done, x = self._decode_layers(x, cos_sin, ctx, i)
            i += done
            if i < len(layers):  # a layer the loop does not take (a dense one, say): its own way
                x = layers[i](x, cos_sin, ctx)
                i += 1
        return self.norm(x)

    @staticmethod
    def _decode_pass(x: torch.Tensor, ctx) -> bool:
        """Whether a pass may run layers in _decode_layers: one decode token of each sequence (the
        context's decode view covers them all), bf16 rows on the CPU, inference."""
        decode = getattr(ctx, "decode", None)
        return (
            decode is not None
            and len(decode.seqs) == len(ctx.seq_lens) == x.shape[0]
            and x.dtype is torch.bfloat16
            and x.is_cpu
            and not torch.is_grad_enabled()
            and native.available()
        )

    def _decode_layers(self, x: torch.Tensor, cos_sin, ctx, start: int = 0):
        """A decode step's tokens x [T, H] (_decode_pass) through the layers from `start` on whose
        attention and MoE halves the decoder layer would run in its native calls
        (DecoderLayer.decode_fields), all in one call (native.decode_layers: the same calls, without
        Python and torch between them on caches the weights' stream has emptied); the blocks then
        tell the runtime what ran. (layers done, the next layer's input); (0, x) where the layer at
        `start` is not taken."""
        plan = self._plan(x, cos_sin, ctx, start)
        if plan is None:
            return 0, x
        table, blocks, workers, qmoe = plan
        cos, sin = cos_sin
        done, x, hs, ids, weights, secs = native.decode_layers(
            table, x, cos, sin, ctx.slots, ctx.decode, workers, qmoe, self.shape.top_k
        )
        for block, h, chosen, mix, seconds in zip(blocks[:done], hs, ids, weights, secs.tolist()):
            block.decoded(h, chosen, mix, seconds)  # [T, H], [T, K], [T, K]
        return done, x

    def _plan(self, x: torch.Tensor, cos_sin, ctx, start: int):
        """(fields table [L, DECODE_FIELDS], the L blocks, the experts' threads, quant.c's entry)
        for _decode_layers from layer `start`, or None where that layer is not taken.

        Each layer's checks (DecoderLayer.decode_fields) ran ~56 us a layer on the caches the
        weights' stream had emptied, 1.7 of the demo model's 22.5 ms a token at one thread: a plan
        is kept, and made again when its key changes (_plan_key: what a step can change) or the
        model does (_changed: weights placed or loaded, routing replayed, train/eval)."""
        key = self._plan_key(x, cos_sin, ctx)
        # a plan for each count of rows and of threads: serving's batches vary, and its decode
        # passes take one core beside a prefill pass, every core alone
        at = (start, x.shape[0], kernel_threads())
        kept = self._plans.get(at)
        # a plan points to attention tables, which a table made anywhere may have freed; a layer
        # not taken points to nothing
        if kept is not None and kept[0] == key and kept[1] in (None, tables_made()):
            return kept[2]
        fields, blocks, workers = [], [], None
        for layer in islice(self.layers, start, None):
            got = layer.decode_fields(x, cos_sin, ctx)
            if got is None or workers not in (None, got[1]) or got[2].top_k != self.shape.top_k:
                break
            fields += got[0]
            workers = got[1]
            blocks.append(got[2])
        plan = None
        if blocks:
            qmoe = (0, 0)
            if native.EXPERTS_IN_BLOCKS in fields[native.DECODE_KIND :: native.DECODE_FIELDS]:
                qmoe = quant_kernels.moe_tokens_entry()
            table = torch.tensor(fields, dtype=torch.int64).view(len(blocks), -1)
            plan = (table, blocks, workers, qmoe)
        self._plans[at] = (key, None if plan is None else tables_made(), plan)
        return plan

    def _plan_key(self, x: torch.Tensor, cos_sin, ctx) -> tuple:
        """What the layers' decode_fields depend on that a step may change: the rows (their count,
        layout, whether each is computed as if alone, the threads), the integer kernels' path, the
        KV cache and which layers' pools it has made, the expert store and the experts' threads,
        the LoRA adapters attached (any, in every dict of them: a few us), the model's version."""
        if self._adapter_dicts is None:
            from hybridmoe.models.lora import adapter_dicts  # lora imports the layers

            self._adapter_dicts = list(adapter_dicts(self))
        kv = getattr(ctx, "cache", None)
        cos = cos_sin[0]
        return (
            self._version,
            x.shape,
            x.stride(),
            cos.shape,
            cos.stride(),
            cos.dtype,
            invariance.active(),
            torch.get_num_threads(),
            quant_kernels.isa(),
            getattr(kv, "serial", None),
            len(kv.pools) if kv is not None else 0,
            self.runtime.decode_key() if self.runtime is not None else None,
            any(self._adapter_dicts),
        )

    def place(self) -> None:
        """Put every dense weight and buffer where the expert runtime keeps the rest of the model:
        embeddings, attention, norms, routers, shared experts and the head on the accelerator
        with the hybrid runtime (the routed experts stay in its store, in host RAM); where they
        are otherwise. Weights in blocks (QTensor attributes) go as their blocks."""
        if self.runtime is None:
            return
        put = self.runtime.place
        for module in self.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    data = t.data  # a new tensor object on each access: taken once
                    moved = put(data)
                    if moved is not data:
                        table[name] = (
                            nn.Parameter(moved, t.requires_grad)
                            if isinstance(t, nn.Parameter)
                            else moved
                        )
            for name, value in list(vars(module).items()):
                if isinstance(value, QTensor):
                    setattr(
                        module,
                        name,
                        QTensor(put(value.data), value.fmt, value.cols, value.keep_layout),
                    )
        self.device = self.runtime.device
        self._changed()

    def place_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor made for the model (a KV pool) put where the model lives."""
        return t if self.runtime is None else self.runtime.place(t)

    @property
    def reentrant(self) -> bool:
        """Whether two forward passes may run at once,
        on two threads (the engine's overlap_prefill)."""
        return self.runtime is None or self.runtime.reentrant

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]: the embeddings' when they are tied."""
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] -> fp32 logits [n, V]."""
        return linear(hidden, self.head_weight).float()

    # ---- loading ----
    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to a parameter name; None skips the tensor."""
        if "rotary_emb.inv_freq" in name:
            return None
        return name.removeprefix("model.")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs in, one at a time; routed experts go to the runtime's store."""
        self._changed()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            if self._load_expert(name, tensor, pending):
                continue
            target = self.checkpoint_name(name)
            if target is None or (target == "lm_head.weight" and self.tied):
                continue
            if target not in params:
                raise ModelFileError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "the checkpoint does not match its config.json"
                )
            param = params[target]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelFileError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config "
                    f"implies {tuple(param.shape)}; the checkpoint does not match its config.json"
                )
            self._place(target, param, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelFileError(
                f"the checkpoint has no tensor for {missing[0]} ({len(missing)} missing); "
                "it is incomplete or of another architecture"
            )
        if self.runtime is not None:
            if pending:
                (layer, expert), parts = next(iter(pending.items()))
                raise ModelFileError(
                    f"expert {expert} of layer {layer} lacks "
                    f"{sorted({'gate', 'up', 'down'} - set(parts))}"
                )
            self.runtime.finish_loading()

    def _place(self, target: str, param: nn.Parameter, tensor) -> None:
        """Put a checkpoint tensor in `target`'s place: in blocks where its module computes on them
        (a QTensor from the file, or a dense weight quantised at load to `self.quant`), else
        copied into the arena (native/huge_pages.py) in the parameter's dtype."""
        module_name, _, attr = target.rpartition(".")
        module = self.get_submodule(module_name)
        blocks = attr == "weight" and isinstance(module, (Linear, Embedding)) and module.quantizable
        if (
            blocks
            and self.quant
            and not isinstance(tensor, QTensor)
            and suits(FORMATS[self.quant], tensor.shape[-1])
        ):
            tensor = QTensor.quantize(tensor, self.quant)
        if blocks and isinstance(tensor, QTensor):
            delattr(module, "weight")
            # an embedding's rows are looked up one by one: only products take the kernels' layout
            module.weight = tensor if isinstance(module, Embedding) else for_kernels(tensor)
            module.dtype = param.dtype  # what an Embedding's looked-up rows come out as
            return
        values = tensor.dequantize(param.dtype) if isinstance(tensor, QTensor) else tensor
        param.data = arena().copy(values.to(param.dtype))  # in 2 MB pages: the kernels stream it

    def _load_expert(self, name: str, tensor: torch.Tensor, pending: dict) -> bool:
        """Route an expert tensor to the runtime's store; False when `name` is not an expert's."""
        if self.runtime is None:
            return False
        m = _EXPERT.match(name)
        if m:
            role = _ROLE.get(m[3])
            if role is not None:
                self._add_part(pending, int(m[1]), int(m[2]), {role: tensor})
            return role is not None
        m = _FUSED.match(name)
        if m:
            for expert in range(tensor.shape[0]):
                if m[2] == "gate_up_proj":  # [E, 2I, H]
                    inter = tensor.shape[1] // 2
                    parts = {"gate": tensor[expert, :inter], "up": tensor[expert, inter:]}
                else:  # [E, H, I]
                    parts = {"down": tensor[expert]}
                self._add_part(pending, int(m[1]), expert, parts)
            return True
        return False

    def _add_part(
        self, pending: dict, layer: int, expert: int, parts: dict[str, torch.Tensor]
    ) -> None:
        """Collect an expert's gate, up and down; store it once all three are in."""
        got = pending.setdefault((layer, expert), {})
        got.update(parts)
        if len(got) == 3:
            self.runtime.store.put(layer, expert, got["gate"], got["up"], got["down"])
            del pending[(layer, expert)]
