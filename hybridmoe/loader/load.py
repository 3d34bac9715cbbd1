"""One entry point: a path (HF directory or .gguf file) -> a ready model and its tokenizer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError, UserError
from hybridmoe.experts.plan.shape import ExpertShape, expert_shape
from hybridmoe.experts.run.runtime import CPURuntime, ExpertRuntime
from hybridmoe.loader import safetensors_dir
from hybridmoe.loader.free_memory import give_back_heap
from hybridmoe.loader.tokenizer import Tokenizer, load_tokenizer_dir, load_tokenizer_gguf
from hybridmoe.models import model_class
from hybridmoe.quant.formats import QUANTIZE_TO

RuntimeFactory = Callable[[ExpertShape, torch.dtype], ExpertRuntime]

GGUF_MAGIC = b"GGUF"


def _resolve(path: str | Path) -> tuple[Path, str]:
    """(path, kind) where kind is 'hf' or 'gguf'; a clear error for anything else."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"{p}: no such file or directory; pass --model with a Hugging Face directory or a "
            ".gguf file"
        )
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelFileError(
                f"{p}: no config.json; a Hugging Face model directory needs config.json "
                "beside its *.safetensors"
            )
        return p, "hf"
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return p, "gguf"
    raise ModelFileError(
        f"{p}: neither a directory nor a GGUF file (it starts with {magic!r}); "
        "pass a Hugging Face directory or a .gguf file"
    )


def model_config(path: str | Path) -> HFConfig:
    p, kind = _resolve(path)
    if kind == "hf":
        return HFConfig.from_file(p / "config.json")
    from hybridmoe.loader import gguf_file

    return gguf_file.read_config(p)


def expert_format(path: str | Path, dtype: torch.dtype, quant: str | None = None) -> str:
    """The format load_model will keep the routed experts in (the cost model's name): the block
    format of most of a GGUF file's expert bytes; for a checkpoint, ExpertStore's choice for its
    expert shape (quantised to `quant` where rows fill the blocks, else dense in `dtype`)."""
    from hybridmoe.experts.run.store import DTYPE_FORMAT, kept_format
    from hybridmoe.quant.formats import FORMATS

    p, kind = _resolve(path)
    if kind == "hf":
        shape = expert_shape(model_config(p))
        return kept_format(shape.hidden, shape.intermediate, dtype, quant) if shape else ""
    from hybridmoe.loader import gguf_file

    held = gguf_file.expert_types(p)
    name = max(held, key=held.get).lower() if held else ""
    return name if name in FORMATS else DTYPE_FORMAT.get(dtype, "bf16")


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    runtime_factory: RuntimeFactory | None = None,
    progress: bool = True,
    quant: str | None = None,
    copy_blocks: bool = True,
):
    """Build the model for `path` and stream its weights in. Routed experts go to the runtime.

    Weights a GGUF file stores in blocks stay in them; `quant` (a format of hybridmoe.quant.formats)
    quantises dense weights to blocks as they stream in: the linears and the routed experts.
    `copy_blocks=False` reads every block of a GGUF file where it lies in the file's map, as the
    loader does with the blocks beyond its share of free memory (gguf_file.py)."""
    p, kind = _resolve(path)
    cfg = model_config(p)
    cls = model_class(cfg, where=str(p))
    shape = expert_shape(cfg)
    runtime = None
    if quant is not None and quant not in QUANTIZE_TO:
        raise UserError(
            f"--quant {quant}: quantising at load makes {', '.join(QUANTIZE_TO)}; pick one"
        )
    if shape is not None:
        runtime = (runtime_factory or CPURuntime)(shape, dtype)
        runtime.store.quant = quant
    with torch.device("meta"):
        model = cls(cfg, runtime)
    model = model.to(dtype).to_empty(device="cpu")  # uninitialised; every parameter is loaded below
    model.quant = quant
    if kind == "hf":
        files = safetensors_dir.safetensors_files(p)
        total, tensors = safetensors_dir.count_tensors(files), safetensors_dir.iter_tensors(files)
    else:
        from hybridmoe.loader import gguf_file

        total, tensors = gguf_file.count_tensors(p), gguf_file.iter_tensors(p, cfg, copy_blocks)
    bar = tqdm(
        tensors,
        total=total,
        desc=f"loading {p.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    try:
        model.load_weights(_heap_trimmed(bar))
    except (
        ModelFileError
    ) as e:  # the model knows which tensor is wrong, not which file it came from
        if str(p) in str(e):
            raise
        raise ModelFileError(f"{p}: {e}") from None
    model.place()  # the dense model where the runtime keeps it (an accelerator, or the host)
    model.eval()
    return model


def _heap_trimmed(tensors, every: int = 64):
    """The (name, tensor) pairs, the heap's free pages given back after every `every` of them and
    at the end (free_memory.give_back_heap): the read buffers the model copied from are free."""
    for i, item in enumerate(tensors):
        yield item
        if i % every == every - 1:
            give_back_heap()
    give_back_heap()


def load_tokenizer(path: str | Path, tokenizer_dir: str | Path | None = None) -> Tokenizer:
    if tokenizer_dir is not None:
        d = Path(tokenizer_dir).expanduser()
        if not d.is_dir():
            raise UserError(
                f"{d}: --tokenizer must be a directory holding tokenizer.json or tokenizer.model"
            )
        return load_tokenizer_dir(d)
    p, kind = _resolve(path)
    return load_tokenizer_dir(p) if kind == "hf" else load_tokenizer_gguf(p)
