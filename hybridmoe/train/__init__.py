"""Fine-tuning: LoRA adapters trained on the CPU with the routed experts left in the expert store.

data.py reads and tokenises the JSONL data, forward.py runs a training pass and its loss, trainer.py
is the loop (schedule, accumulation, held-out loss, checkpoints), checkpoint.py its files; the
adapters themselves are models/lora.py's, saved in PEFT's format by loader/adapter.py.
"""
