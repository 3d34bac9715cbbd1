"""The planner's split of a layer in C (split.c), for hybridmoe/experts/plan/planner.py: which
in-flight experts and how many leading copy options go to the GPU, in one call where the Python
takes a few hundred operations. The same bits and the same ties as `Planner._best_split`
(tests/test_split_kernels.py).

Torch-free, so that the planner and the simulator may use it. Without a C compiler, or with
HYBRIDMOE_NATIVE=0, `library()` is None and the planner keeps its Python split.
"""

from __future__ import annotations

import ctypes
from array import array
from functools import lru_cache
from pathlib import Path

import numpy as np

from hybridmoe.native.build import N, P, load

SOURCE = Path(__file__).with_name("split.c")
# floats exactly as written (no contraction into FMAs), so that they round as Python's do
FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off"]
_D = ctypes.c_double

# name -> (argument types, result type), each under a copy of its C prototype in split.c
SIGNATURES = {
    # long hm_best_split(const split_t *s, const long *n, const double *x, double *out)
    "hm_best_split": ([P, P, P, P], N),
}


class SplitT(ctypes.Structure):
    _fields_ = [
        ("cpu", P),
        ("gpu", P),
        ("n_table", N),
        ("t_copy", _D),
        ("slowdown", _D),
        ("row", _D),
        ("fixed", _D),
        ("late_subsets", N),
    ]


@lru_cache(maxsize=1)
def library():
    return load(SOURCE, FLAGS, SIGNATURES)


class Split:
    """hm_best_split bound to one planner's times: its CPU and GPU seconds by token count, in
    tables grown as larger counts come (`cpu_of`, `gpu_of`: the planner's own figures), and its
    constants (t_copy, slowdown, row, fixed: seconds; late_subsets)."""

    def __init__(self, lib, cpu_of, gpu_of, constants: dict):
        self.lib, self._cpu_of, self._gpu_of = lib, cpu_of, gpu_of
        self._call = lib.hm_best_split
        self.struct = SplitT(**constants)
        self.p = ctypes.addressof(self.struct)
        self._out = array("d", [0.0, 0.0])  # [2]: the cost, the in-flight experts on the GPU
        self._out_at = self._out.buffer_info()[0]
        self._grow(64)

    def _grow(self, n: int) -> None:
        """Tables of at least n token counts, 0..n-1 (twice as many as before at least)."""
        size = max(n, 2 * getattr(self, "_size", 0))
        self.cpu = np.array([self._cpu_of(t) for t in range(size)])  # [size] seconds
        self.gpu = np.array([self._gpu_of(t) for t in range(size)])  # [size] seconds
        self._size = self.struct.n_table = size
        self.struct.cpu, self.struct.gpu = self.cpu.ctypes.data, self.gpu.ctypes.data

    def best(self, now, copy_free, tokens, sizes, counts, floats):
        """(makespan - value, in-flight experts on the GPU: a bit each, or beyond late_subsets
        how many leading ones, b: leading options copied), or None where C cannot say. sizes:
        (GPU hits, in-flight experts, copy options, stranded misses); counts: their token counts,
        in that order; floats: the in-flight experts' ready times, then the options' gains."""
        n = array("l", (tokens, *sizes))  # [5 + experts]: hm_best_split's n
        n.extend(counts)
        x = array("d", (now, copy_free))  # [2 + late + options]: its x
        x.extend(floats)
        b = self._call(self.p, n.buffer_info()[0], x.buffer_info()[0], self._out_at)
        if b < 0 and max(counts, default=0) >= self._size:
            self._grow(max(counts) + 1)
            b = self._call(self.p, n.buffer_info()[0], x.buffer_info()[0], self._out_at)
        if b < 0:
            return None
        return self._out[0], int(self._out[1]), b
