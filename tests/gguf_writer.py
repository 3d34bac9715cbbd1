"""Test helper: write a GGUF file from a saved Hugging Face checkpoint with one GGML type for every
matrix, through the production exporter's parts (hybridmoe/export: llama.cpp's names and layout,
metadata, encoders), plus what only tests need: any single type (F32, F16, Q4_1, MXFP4...), a
tensor left out (`drop`), another architecture name, and Mixtral's legacy per-expert tensors.

Rows that do not fill whole blocks, norms, biases and (in block formats) routers stay F32 here, as
the tests' bounds assume; `hybridmoe export` falls back as llama.cpp does instead."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from hybridmoe.export.encode import encode, nbytes
from hybridmoe.export.gguf_layout import Planned, permute_rows, plan
from hybridmoe.export.gguf_metadata import ARCHITECTURES, architecture, write_metadata
from hybridmoe.export.sources import Checkpoint

Q = gguf.GGMLQuantizationType
GGUF_ARCH = ARCHITECTURES
__all__ = ["GGUF_ARCH", "Q", "permute_rows", "write_gguf"]


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: Q = Q.F32,
    drop: str | None = None,
    arch_name: str | None = None,
    legacy_experts: bool = False,
) -> Path:
    """Convert the checkpoint in `hf_dir` to the GGUF file `out`, every matrix in `qtype`.
    `legacy_experts` writes one tensor per expert, blk.N.ffn_up.E.weight, as llama.cpp did before
    it stacked them."""
    source = Checkpoint(Path(hf_dir))
    cfg = source.config
    arch = architecture(cfg)
    writer = gguf.GGUFWriter(str(out), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(writer, cfg, gguf.LlamaFileType.ALL_F32, Path(hf_dir).name)
    for t in plan(source.shapes, source.read, cfg, arch):
        if t.name == drop:
            continue
        if legacy_experts and t.name.endswith("_exps.weight"):
            layer, base = t.layer, t.name.split(".")[2].removesuffix("_exps")
            for e, part in enumerate(t.parts):  # blk.0.ffn_up_exps -> blk.0.ffn_up.E
                add_tensor(
                    writer, Planned(f"blk.{layer}.{base}.{e}.weight", t.shape[1:], [part]), qtype
                )
            continue
        add_tensor(writer, t, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tensor(writer: gguf.GGUFWriter, t: Planned, qtype: Q) -> None:
    """Norms, biases and (in block formats) routers stay F32, as llama.cpp keeps them; a matrix
    whose rows do not fill whole blocks falls back to F32 too."""
    data = torch.cat([p().float().reshape(-1, t.shape[-1]) for p in t.parts])  # [rows, cols]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    router = block > 1 and "ffn_gate_inp" in t.name
    if len(t.shape) < 2 or not t.name.endswith(".weight") or t.shape[-1] % block or router:
        qtype = Q.F32
    # types the engine does not read (MXFP4: the unreadable-type test) from gguf's own quantiser
    raw = gguf.quants.quantize(data.numpy(), qtype) if qtype == Q.MXFP4 else encode(data, qtype)
    assert raw.nbytes == nbytes(qtype, t.shape)
    writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), raw.nbytes, raw_dtype=qtype)
    writer.tensors[-1][t.name].tensor = raw
