"""The fine-tuning loop: a LoRA adapter on a loaded model, AdamW, a cosine schedule with warm-up,
gradient accumulation, the held-out loss each epoch, checkpoints a killed run resumes from, and the
adapter written in PEFT's format at every checkpoint and at the end.

    run = Trainer(model, data, FinetuneConfig(...), out, base_model="my-model")
    result = run.train()

The base model stays frozen and where it is: dense weights in the model, routed experts in the
expert runtime's store (their backward is experts/run/expert_grad.py); only the adapter's tensors
take gradients and optimizer state.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.errors import UserError
from hybridmoe.files import write_atomic
from hybridmoe.loader.adapter import save_adapter
from hybridmoe.models import lora as model_lora
from hybridmoe.train import checkpoint
from hybridmoe.train.config import SAME_ON_RESUME, FinetuneConfig
from hybridmoe.train.data import Example, Prepared, batches
from hybridmoe.train.forward import Batch, loss_sum
from hybridmoe.train.heap import keep_freed_memory, release_free_heap
from hybridmoe.train.schedule import cosine_with_warmup

ADAPTER = "finetune"  # the adapter's name inside the model while it trains
STATE = "trainer_state.json"  # the run's figures, beside the adapter


@dataclass
class Result:
    steps: int
    held_out: list[float | None] = field(default_factory=list)  # [0]: before training
    train_loss: list[float] = field(default_factory=list)  # mean per epoch
    tokens: int = 0  # tokens through the model, this process
    seconds: float = 0.0  # wall time of those steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class Trainer:
    def __init__(self, model, data: Prepared, cfg: FinetuneConfig, out: Path, base_model: str = ""):
        self.model, self.data, self.cfg, self.out = model, data, cfg, Path(out)
        self.base_model = base_model
        self.targets = model_lora.select(model, cfg.targets)
        model_lora.check_rank(self.targets, cfg.lora_rank)
        if cfg.lora_dropout and not model_lora.dropout_allowed(model, self.targets):
            raise UserError(
                f"--lora-dropout {cfg.lora_dropout}: peft's LoRA on expert, router and MoE-MLP "
                "weights has no dropout; give 0 or --targets attention"
            )
        self.modules = model_lora.attach(
            self.targets, ADAPTER, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout
        )
        gen = torch.Generator().manual_seed(cfg.seed)
        for m in self.modules.values():
            m.reset(gen)
        self.params = model_lora.parameters(self.modules)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        passes = math.ceil(len(data.train) / cfg.batch_size)
        self.steps_per_epoch = math.ceil(passes / cfg.grad_accum)
        self.total = cfg.epochs * self.steps_per_epoch
        warmup = round(cfg.warmup * self.total)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: cosine_with_warmup(s, self.total, warmup)
        )
        self.result = Result(0)
        self._epoch_losses: list[float] = []

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of the adapter's tensors, their gradients and AdamW's two moments."""
        return 4 * sum(p.numel() * p.element_size() for p in self.params)

    # ---- resuming ----
    def resume(self) -> None:
        state = checkpoint.load_checkpoint(self.out)
        saved = state["config"]
        for name in SAME_ON_RESUME + ("epochs",):
            if saved.get(name) != getattr(self.cfg, name):
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"--resume: the checkpoint in {self.out} was made with {flag} "
                    f"{saved.get(name)}, this run has {getattr(self.cfg, name)}; give the same"
                )
        if state["train_examples"] != len(self.data.train):
            raise UserError(
                f"--resume: the checkpoint was made on {state['train_examples']} training "
                f"examples, the data now gives {len(self.data.train)}; resume on the same data"
            )
        with torch.no_grad():
            for p, saved_p in zip(self.params, state["params"]):
                p.copy_(saved_p)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.result.steps = state["step"]
        self.result.held_out = list(state["held_out"])
        self.result.train_loss = list(state["train_loss"])
        self._epoch_losses = list(state["epoch_losses"])

    def _checkpoint(self) -> None:
        self._save_adapter()
        checkpoint.save_checkpoint(
            self.out,
            {
                "step": self.result.steps,
                "params": [p.detach().clone() for p in self.params],
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "rng": torch.get_rng_state(),
                "config": asdict(self.cfg),
                "train_examples": len(self.data.train),
                "held_out": self.result.held_out,
                "train_loss": self.result.train_loss,
                "epoch_losses": self._epoch_losses,
            },
        )

    def _save_adapter(self) -> None:
        c = self.cfg
        save_adapter(
            self.model,
            self.targets,
            self.modules,
            self.out,
            c.lora_rank,
            c.lora_alpha,
            c.lora_dropout,
            self.base_model,
        )

    # ---- the loop ----
    def train(self, progress: bool = True) -> Result:
        self.model.requires_grad_(False)  # the base model is frozen: no gradient is ever made
        keep_freed_memory()  # a step's tensors reuse the last one's memory (heap.py)
        r = self.result
        if r.steps == 0:
            r.held_out = [self.held_out_loss()]
        bar = tqdm(
            total=self.total,
            initial=r.steps,
            desc="finetune",
            unit="step",
            file=sys.stderr,
            disable=not progress,
        )
        with bar:
            while r.steps < self.total:
                t0 = time.perf_counter()
                loss, tokens = self._step(self._micro_batches(r.steps))
                r.seconds += time.perf_counter() - t0
                r.tokens += tokens
                r.steps += 1
                self._epoch_losses.append(loss)
                bar.update()
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{r.tokens_per_s:.0f}")
                if r.steps % self.steps_per_epoch == 0:
                    bar.write(self._end_epoch(r.steps // self.steps_per_epoch), file=sys.stderr)
                if r.steps % self.steps_per_epoch == 0 or r.steps % self.cfg.save_every == 0:
                    self._checkpoint()
        self._save_adapter()
        write_atomic(self.out / STATE, json.dumps({**asdict(r), "config": asdict(self.cfg)}))
        checkpoint.remove_checkpoint(self.out)
        return r

    def _micro_batches(self, step: int) -> list[list[Example]]:
        """Step `step`'s passes: the accumulated micro-batches of its epoch's shuffled order."""
        epoch, k = divmod(step, self.steps_per_epoch)
        a = self.cfg.grad_accum
        return batches(self.data.train, self.cfg.batch_size, self.cfg.seed, epoch)[
            k * a : (k + 1) * a
        ]

    def _step(self, micro: list[list[Example]]) -> tuple[float, int]:
        """One optimizer step over the passes `micro`; (mean loss per target token, tokens)."""
        self.model.train()
        targets = sum(ex.num_targets for group in micro for ex in group)
        total, tokens = 0.0, 0
        for group in micro:
            batch = Batch.of([(ex.tokens, ex.learn) for ex in group])
            loss = loss_sum(self.model, batch, ADAPTER)
            (loss / targets).backward()
            total += loss.item()
            tokens += batch.num_tokens
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        release_free_heap()  # so that steps do not pile up freed, still resident pages (heap.py)
        return total / targets, tokens

    def _end_epoch(self, epoch: int) -> str:
        r = self.result
        r.train_loss.append(sum(self._epoch_losses) / len(self._epoch_losses))
        self._epoch_losses = []
        r.held_out.append(self.held_out_loss())
        line = f"epoch {epoch}/{self.cfg.epochs}: train loss {r.train_loss[-1]:.4f}"
        if r.held_out[-1] is not None:
            line += f", held-out loss {r.held_out[-1]:.4f} (before training {r.held_out[0]:.4f})"
        return line

    @torch.no_grad()
    def held_out_loss(self) -> float | None:
        """Mean loss per target token over the held-out examples (None without any)."""
        if not self.data.held_out:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for k in range(0, len(self.data.held_out), self.cfg.batch_size):
            group = self.data.held_out[k : k + self.cfg.batch_size]
            batch = Batch.of([(ex.tokens, ex.learn) for ex in group])
            total += loss_sum(self.model, batch, ADAPTER).item()
            count += batch.num_targets
        return total / count
