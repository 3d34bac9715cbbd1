"""The arena of 2 MB-paged memory the weights and KV pools live in (native/huge_pages.py): pieces
are aligned and apart, hold what was put in them, outlive the arena, sit in mappings asked for huge
pages, and a pool's own mapping goes with its last view."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from hybridmoe.engine.paged_kv import PagedKVCache
from hybridmoe.native import huge_pages
from hybridmoe.native.huge_pages import Arena
from tests.test_gguf_mapped import mapping_of

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def asked_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether t's mapping carries madvise(MADV_HUGEPAGE)'s flag, where this kernel has THP."""
    flags = mapping_of(t.data_ptr())["VmFlags"]
    return "hg" in flags if THP.exists() else True


def test_pieces_are_aligned_apart_and_keep_their_values():
    arena = Arena(chunk=4 << 20)
    g = torch.Generator().manual_seed(0)
    made = [torch.randn(n, generator=g) for n in (1, 17, 1000, 300_000, 2_000_000)]  # 8 MB last
    copies = [arena.copy(t) for t in made]
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * 4) for c in copies)
    assert all(a % huge_pages.ALIGN == 0 for a, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    del arena
    gc.collect()
    assert all(torch.equal(c, t) for c, t in zip(copies, made))  # the chunks live with the pieces
    assert all(asked_for_huge_pages(c) for c in copies)


def test_cat_is_torchs():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(3, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    joined = huge_pages.arena().cat(parts)
    assert joined.dtype == torch.bfloat16 and torch.equal(joined, torch.cat(parts))


def test_a_pool_is_zeros_in_a_mapping_of_its_own_that_goes_with_it():
    pool = huge_pages.zeros((1000, 4, 128), torch.bfloat16)
    assert pool.shape == (1000, 4, 128) and not pool.any()
    assert asked_for_huge_pages(pool) and pool.data_ptr() % huge_pages.HUGE == 0
    start = pool.data_ptr()
    del pool
    gc.collect()
    assert mapping_of(start) is None  # unmapped


def test_the_kv_caches_pools_on_the_cpu_are_in_huge_pages():
    cache = PagedKVCache(num_blocks=8, block_size=16)
    entries = (torch.ones(2, 4, 128, dtype=torch.bfloat16),) * 2
    pools = cache.layer_pools(0, entries)
    assert all(p.shape == (128, 4, 128) and not p.any() and asked_for_huge_pages(p) for p in pools)
