"""A GGUF file's blocks (routed experts, linears, the output head) are copied at load into the
process's memory in 2 MB pages (native/huge_pages.py) while they fit in a share of the free memory,
the file's pages let go of as each is copied, never held beside the copy; Q4_K matrices there are
rearranged into rows of eight where the AVX-512 path reads them so (quant/interleave.py). The rest
stay views of the file's memory map, file-backed pages the kernel may drop and read again, in their
layout. Either way the file is never written, and a matrix whose rows lie in two places (an
expert's gate and up) computes exactly as the same rows joined."""

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
from hybridmoe.loader.free_memory import CopyBudget, available_bytes
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import Q4_K_X8
from hybridmoe.quant.interleave import deinterleave
from hybridmoe.quant.tensor import QTensor, matmul
from hybridmoe.tuning import COPY_SHARE_OF_FREE
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


def mapping_of(ptr: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding address `ptr`: its kB fields, VmFlags."""
    found = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            if found is not None:
                break
            start, end = (int(v, 16) for v in head[0].split("-"))
            found = {"start": start, "end": end} if start <= ptr < end else None
        elif found is not None and head[0] == "VmFlags:":
            found["VmFlags"] = head[1:]
        elif found is not None and head[0].endswith(":") and len(head) >= 2:
            found[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
    return found


def parts_of(model) -> list[torch.Tensor]:
    return [p for w in weights_of(model) for p in w.parts]


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    path = wide_mixtral_gguf(tmp_path_factory.mktemp("mapped"), Q.Q4_K)
    return path, load_model(path, progress=False)


def test_a_gguf_models_blocks_are_copies_in_2mb_pages_with_the_files_bytes(mapped):
    path, model = mapped
    maps = file_mappings(path)  # none, where no tensor views the map any more
    dense = [model.lm_head.weight, model.layers[1].self_attn.v_proj.weight]
    for part in parts_of(model) + [m.parts[0] for m in dense]:
        assert not inside(part, maps)
        held = mapping_of(part.data_ptr())
        assert held["Anonymous"] > 0 and "hg" in held["VmFlags"]  # madvise(MADV_HUGEPAGE)
    w = model.runtime.store.get(1, 2)
    assert len(w.gate_up.parts) == 2  # gate and up as the file keeps them, not joined
    for part, fmt, name in zip(
        (*w.gate_up.parts, *w.down.parts),
        (w.gate_up.fmt, w.gate_up.fmt, w.down.fmt),
        ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
    ):
        # rearranged in the copy where the integer kernels run (every path reads Q4_K in eights)
        assert (fmt == Q4_K_X8) == (kernels.isa() > 0)
        stored = deinterleave(part, fmt.family) if fmt.family else part
        assert np.array_equal(stored.numpy(), file_bytes(path, f"blk.1.{name}.weight", 2))


def test_the_files_pages_are_let_go_and_serving_writes_none(mapped):
    """The copied tensors' pages of the file are not this process's any more (the map goes with
    the last view of it), and serving reads and writes none of it."""
    path, model = mapped
    copied = sum(p.numel() for p in parts_of(model))
    resident = sum(m["Rss"] for m in file_mappings(path)) * 1024
    assert resident < Path(path).stat().st_size - copied + 64 * 4096
    tokens = list(generate_ids(model, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(tokens) == 8
    maps = file_mappings(path)
    assert sum(m["Rss"] for m in maps) * 1024 <= resident  # serving read none of the map
    assert sum(m["Anonymous"] for m in maps) == 0  # nothing wrote the (copy-on-write) map


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
    """Where no block fits in free memory, every matrix stays a view of the file in its layout,
    no page of the file becomes the process's own, and the blocks read in place give the same
    tokens as the copies."""
    path = str(
        tmp_path / "copy.gguf"
    )  # the same bytes in a file of its own: its map is this model's
    shutil.copyfile(mapped[0], path)
    monkeypatch.setattr(gguf_file, "available_bytes", lambda: 0)
    model = load_model(path, progress=False)
    weights = weights_of(model)
    weights.append(model.layers[1].self_attn.v_proj.weight)  # q/k: rows reordered, copies
    maps = file_mappings(path)
    assert all(m.fmt != Q4_K_X8 and m.keep_layout for m in weights)
    assert all(inside(p, maps) for m in weights for p in m.parts)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kept = list(generate_ids(model, PROMPT, greedy))
    assert kept == list(generate_ids(mapped[1], PROMPT, greedy))
    assert sum(m["Anonymous"] for m in file_mappings(path)) == 0


def test_a_model_asked_to_read_its_blocks_in_place_copies_none(mapped, tmp_path):
    """load_model(copy_blocks=False) (bench generate --in-place: a machine short of memory, with
    all the memory this one has free): every block a view of the file in its layout, the same
    tokens as the copies."""
    path = str(tmp_path / "in-place.gguf")
    shutil.copyfile(mapped[0], path)
    model = load_model(path, progress=False, copy_blocks=False)
    weights = weights_of(model)
    maps = file_mappings(path)
    assert all(m.fmt != Q4_K_X8 and m.keep_layout for m in weights)
    assert all(inside(p, maps) for m in weights for p in m.parts)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert list(generate_ids(model, PROMPT, greedy)) == list(
        generate_ids(mapped[1], PROMPT, greedy)
    )


def test_blocks_are_copied_while_they_fit_and_the_rest_read_in_place(mapped, tmp_path, monkeypatch):
    """A budget for about half the experts' bytes: the first matrices in file order are copies,
    the later ones views of the map, and the model gives the same tokens."""
    path = str(tmp_path / "half.gguf")
    shutil.copyfile(mapped[0], path)
    half = sum(p.numel() for p in parts_of(mapped[1])) // 2
    monkeypatch.setattr(gguf_file, "available_bytes", lambda: int(half / COPY_SHARE_OF_FREE))
    model = load_model(path, progress=False)
    maps = file_mappings(path)
    in_map = [inside(p, maps) for p in parts_of(model)]
    assert any(in_map) and not all(in_map)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert list(generate_ids(model, PROMPT, greedy)) == list(
        generate_ids(mapped[1], PROMPT, greedy)
    )
    assert sum(m["Anonymous"] for m in file_mappings(path)) == 0


def weights_of(model) -> list:
    return [m for w in model.runtime.store.records.values() for m in (w.gate_up, w.down)]


def test_copies_take_at_most_a_share_of_the_free_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemAvailable:    4000000 kB\n")
    assert available_bytes(meminfo) == 4000000 * 1024
    assert available_bytes(tmp_path / "absent") is None
    free = available_bytes()  # this machine's, where Linux reports it
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert free is None or 0 < free <= physical
    share = int(COPY_SHARE_OF_FREE * 4096e6)
    budget = CopyBudget(4096e6)
    assert budget.take(share - 10) and not budget.take(11) and budget.take(10)
    assert not budget.take(1) and budget.take(0)
    assert not CopyBudget(None).take(1)
