"""Every knob of a fine-tuning run. A field with a help text in its metadata is also a flag of
`hybridmoe finetune` (cli/options.py add_config_flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Settings a resumed run must share with the run it continues (the others may change: --epochs can
# grow, --save-every and the held-out split's reporting do not change what is learned so far).
SAME_ON_RESUME = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "targets",
    "lr",
    "warmup",
    "batch_size",
    "grad_accum",
    "max_seq_len",
    "long",
    "eval_fraction",
    "seed",
    "weight_decay",
    "max_grad_norm",
)


@dataclass
class FinetuneConfig:
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r", "metavar": "R"})
    lora_alpha: float = field(
        default=16.0, metadata={"help": "LoRA alpha: the update is scaled by alpha / r"}
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={
            "help": "dropout on the adapters' inputs while training (attention targets only: "
            "peft's LoRA on expert, router and MoE-MLP weights has none)"
        },
    )
    targets: str | None = field(
        default=None,
        metadata={
            "help": "what the adapter changes, comma-separated: groups attention, experts, "
            "shared, mlp, router, or projections (q_proj, experts.down_proj, ...) (default: "
            "attention,experts,shared; the router stays frozen unless named)",
            "metavar": "LIST",
        },
    )
    epochs: int = field(default=3, metadata={"help": "passes over the training examples"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup: float = field(
        default=0.05,
        metadata={
            "help": "fraction of the steps over which the learning rate rises from 0 "
            "(then it follows a cosine to 0)"
        },
    )
    batch_size: int = field(
        default=4,
        metadata={
            "help": "examples per forward pass, packed one after another without padding (each "
            "attends only to itself)"
        },
    )
    grad_accum: int = field(
        default=1, metadata={"help": "passes whose gradients add up to one optimizer step"}
    )
    max_seq_len: int = field(default=1024, metadata={"help": "longest example, in tokens"})
    long: str = field(
        default="truncate",
        metadata={
            "help": "what happens to longer examples",
            "choices": ("truncate", "skip"),
        },
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={"help": "fraction of the data held out to measure loss each epoch"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the adapters, the order and split"})
    save_every: int = field(
        default=50, metadata={"help": "optimizer steps between checkpoints (and every epoch)"}
    )
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # gradient clipping, as transformers' Trainer does by default
