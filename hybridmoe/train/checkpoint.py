"""A run's checkpoint: one file (checkpoint.pt in the output directory) holding everything a killed
run needs to go on as if it had not stopped: the adapter's tensors, the optimizer's and the
schedule's state, the random state (dropout), the step, the held-out losses so far and the settings.
Written whole or not at all (files.py write_atomic), so a kill mid-write leaves the previous one."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from hybridmoe.errors import UserError
from hybridmoe.files import write_atomic

FILE = "checkpoint.pt"
VERSION = 1


def save_checkpoint(out: Path, state: dict) -> None:
    buf = io.BytesIO()
    torch.save({"version": VERSION, **state}, buf)
    write_atomic(out / FILE, buf.getvalue())


def load_checkpoint(out: Path) -> dict:
    path = out / FILE
    if not path.is_file():
        raise UserError(f"--resume: {out} holds no {FILE} to resume from; leave --resume out")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # a damaged file: torch raises several kinds
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0]})") from None
    if state.get("version") != VERSION:
        raise UserError(f"{path}: written by another version of hybridmoe; start a new run")
    return state


def has_checkpoint(out: Path) -> bool:
    return (out / FILE).is_file()


def remove_checkpoint(out: Path) -> None:
    (out / FILE).unlink(missing_ok=True)
