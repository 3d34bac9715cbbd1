"""A GGUF file's blocks stay in the file: the matrices the engine computes on (routed experts,
linears, the output head) are views of the file's memory map, file-backed pages the kernel may
drop and read again, not copies in the process's own (anonymous) memory; except Q4_K matrices
where the AVX-512 path reads them in rows of eight (quant/interleave.py), rearranged in place at
load: their pages become the process's own in the place of the file's, never beside them. And a
matrix whose rows lie in two places (an expert's gate and up) computes exactly as the same rows
joined."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import gguf_file, load_model
from hybridmoe.loader.free_memory import available_bytes, may_rearrange
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import Q4_K_X8
from hybridmoe.quant.interleave import deinterleave
from hybridmoe.quant.tensor import QTensor, matmul
from hybridmoe.tuning import REARRANGE_SHARE_OF_FREE
from tests.gguf_writer import Q
from tests.test_quant_models import PROMPT, wide_mixtral_gguf


def file_mappings(path: str) -> list[dict]:
    """This process's mappings of `path` from /proc/self/smaps: start, end and the kB fields."""
    target, found, current = str(Path(path).resolve()), [], None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            start, end = (int(v, 16) for v in head[0].split("-"))
            current = {"start": start, "end": end} if head[-1] == target else None
            if current is not None:
                found.append(current)
        elif current is not None and head[0].endswith(":") and len(head) >= 2:
            current[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
    return found


def inside(part: torch.Tensor, maps: list[dict]) -> bool:
    first, last = part.data_ptr(), part.data_ptr() + part.numel()
    return any(m["start"] <= first and last <= m["end"] for m in maps)


def file_bytes(path: str, tensor: str, index: int) -> np.ndarray:
    """Slice `index` of a stacked tensor, read from the file with plain reads at its offset."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    size = t.n_bytes // t.data.shape[0]
    with open(path, "rb") as f:
        f.seek(t.data_offset + index * size)
        return np.frombuffer(f.read(size), dtype=np.uint8).reshape(t.data.shape[1:])


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    path = wide_mixtral_gguf(tmp_path_factory.mktemp("mapped"), Q.Q4_K)
    return path, load_model(path, progress=False)


def test_a_gguf_models_blocks_are_views_of_the_file(mapped):
    path, model = mapped
    maps = file_mappings(path)
    assert maps, "the file is not mapped"
    for key, w in model.runtime.store.records.items():
        assert len(w.gate_up.parts) == 2  # gate and up where the file keeps them, not joined
        assert all(inside(p, maps) for p in (*w.gate_up.parts, *w.down.parts)), key
    # (a llama-architecture file's q and k rows are reordered to Hugging Face's order: copies)
    dense = [model.lm_head.weight, model.layers[1].self_attn.v_proj.weight]
    assert all(isinstance(m, QTensor) and inside(m.parts[0], maps) for m in dense)
    w = model.runtime.store.get(1, 2)
    for part, fmt, name in zip(
        (*w.gate_up.parts, *w.down.parts),
        (w.gate_up.fmt, w.gate_up.fmt, w.down.fmt),
        ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
    ):
        stored = deinterleave(part) if fmt == Q4_K_X8 else part
        assert np.array_equal(stored.numpy(), file_bytes(path, f"blk.1.{name}.weight", 2))


def test_serving_from_the_map_reads_file_pages_and_writes_none(mapped):
    path, model = mapped
    # a private (copy-on-write) map: a page written becomes anonymous memory
    rearranged = sum(m["Anonymous"] for m in file_mappings(path))
    tokens = list(generate_ids(model, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(tokens) == 8
    maps = file_mappings(path)
    assert sum(m["Rss"] for m in maps) > 0  # the experts were read where they are
    assert sum(m["Anonymous"] for m in maps) == rearranged  # serving wrote nothing
    # rearranged at load where the kernels read rows in eights, in the file pages' place
    assert (rearranged > 0) == (kernels.isa() == kernels.AVX512)
    assert sum(m["Rss"] for m in maps) * 1024 <= Path(path).stat().st_size + 4096


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
def test_a_matrix_in_two_parts_computes_as_the_rows_joined(fmt):
    if not kernels.available():
        pytest.skip("the products below are the native kernels'")  # the fallback: test_quant.py
    g = torch.Generator().manual_seed(1)
    hidden, inter = 256, 512
    gate, up = (QTensor.quantize(torch.randn(inter, hidden, generator=g), fmt) for _ in range(2))
    down = QTensor.quantize(torch.randn(hidden, inter, generator=g), fmt)
    parts = QTensor.cat([gate, up])
    joined = QTensor(torch.cat([gate.data, up.data]), gate.fmt, hidden)
    assert len(parts.parts) == 2 and parts.parts[0].data_ptr() == gate.data.data_ptr()
    x = torch.randn(5, hidden, generator=g)  # [5, H]
    assert torch.equal(kernels.expert(x, parts, down), kernels.expert(x, joined, down))
    assert torch.equal(matmul(x, parts), matmul(x, joined))
    assert torch.equal(parts.dequantize(), joined.dequantize())
    assert parts.nbytes() == joined.nbytes() and parts.shape == joined.shape


def test_a_file_too_large_for_free_memory_keeps_its_layout(mapped, tmp_path, monkeypatch):
    """Where the Q4_K bytes would not fit in free memory, no page of the file becomes the
    process's own, and the blocks read in place give the same tokens as the rearranged ones."""
    path = str(
        tmp_path / "copy.gguf"
    )  # the same bytes in a file of its own: its map is this model's
    shutil.copyfile(mapped[0], path)
    monkeypatch.setattr(gguf_file, "available_bytes", lambda: 1 << 20)
    model = load_model(path, progress=False)
    weights = [m for w in model.runtime.store.records.values() for m in (w.gate_up, w.down)]
    weights.append(model.layers[1].self_attn.v_proj.weight)  # q/k: rows reordered, copies
    assert all(m.fmt != Q4_K_X8 and m.keep_layout for m in weights)
    assert Q4_K_X8 in {m.fmt for m in weights_of(mapped[1])} or kernels.isa() != kernels.AVX512
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kept = list(generate_ids(model, PROMPT, greedy))
    assert kept == list(generate_ids(mapped[1], PROMPT, greedy))
    assert sum(m["Anonymous"] for m in file_mappings(path)) == 0


def weights_of(model) -> list:
    return [m for w in model.runtime.store.records.values() for m in (w.gate_up, w.down)]


def test_rearranging_takes_at_most_a_share_of_the_free_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemAvailable:    4000000 kB\n")
    assert available_bytes(meminfo) == 4000000 * 1024
    assert available_bytes(tmp_path / "absent") is None
    free = available_bytes()  # this machine's, where Linux reports it
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert free is None or 0 < free <= physical
    share = int(REARRANGE_SHARE_OF_FREE * 4096e6)
    assert may_rearrange(share, 4096e6) and not may_rearrange(share + 1, 4096e6)
    assert may_rearrange(0, None) and not may_rearrange(1, None)
