"""Write a model as a GGUF file that llama.cpp loads: metadata, tokenizer, tensor infos, then the
tensors streamed one part at a time (an expert of a stack, or a whole dense tensor), encoded on a
few threads, into a temporary file renamed into place at the end. Peak memory is a tensor's parts
in flight, never the model."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from hybridmoe.errors import UserError
from hybridmoe.export import gguf_types
from hybridmoe.export.encode import encode, nbytes
from hybridmoe.export.gguf_layout import Planned, plan
from hybridmoe.export.gguf_metadata import architecture, expert_count, write_metadata
from hybridmoe.export.gguf_tokenizer import write_tokenizer
from hybridmoe.export.sources import Source
from hybridmoe.files import atomic_path

Q = gguf.GGMLQuantizationType


def export_gguf(
    source: Source,
    out: str | Path,
    fmt: str,
    progress: bool = True,
    threads: int = 2,
    tokenizer: bool = True,
) -> Path:
    """Write `source` to the GGUF file `out` in `fmt` (gguf_types.FORMATS); returns `out`."""
    if fmt not in gguf_types.FORMATS:
        raise UserError(f"--format {fmt}: GGUF export writes {', '.join(gguf_types.FORMATS)}")
    out = Path(out).expanduser()
    cfg = source.config
    arch = architecture(cfg)
    tensors = plan(source.shapes, source.read, cfg, arch)
    mix = gguf_types.mix(fmt, [t.name for t in tensors], cfg, expert_count(cfg))
    types = [mix.choose(t.name, t.shape, t.layer) for t in tensors]
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        write_metadata(w, cfg, gguf_types.FILE_TYPES[fmt], source.name)
        if tokenizer and source.tokenizer_dir is not None:
            write_tokenizer(w, source.tokenizer_dir, cfg["vocab_size"])
        else:  # llama.cpp refuses a file that names no tokenizer; "none" loads without one
            w.add_tokenizer_model("none")
        for t, qtype in zip(tensors, types):
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes(qtype, t.shape), qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(nbytes(q, t.shape) for t, q in zip(tensors, types))
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"writing {out.name}",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        ) as bar:
            _write_data(w.fout[0], tensors, types, bar, threads, w.data_alignment)
        w.close()
    return out


def _write_data(f, tensors: list[Planned], types: list[Q], bar, threads: int, align: int) -> None:
    """Each tensor's bytes at the next multiple of `align`, in the order of the tensor infos
    (whose offsets assumed exactly that)."""
    _pad(f, align)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for t, qtype in zip(tensors, types):
            written = 0
            # parts in order; a stack's experts are read and encoded on `threads` threads
            for data in pool.map(lambda part, q=qtype: encode(part(), q), t.parts):
                f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                written += data.nbytes
                bar.update(data.nbytes)
            if written != nbytes(qtype, t.shape):
                raise RuntimeError(
                    f"{t.name}: wrote {written} bytes, planned {nbytes(qtype, t.shape)}"
                )
            _pad(f, align)


def _pad(f, align: int) -> None:
    f.write(b"\0" * (-f.tell() % align))
