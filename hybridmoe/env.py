"""The environment variables hybridmoe reads or sets, all of them, in one place.

| variable          | effect                                                              |
|-------------------|---------------------------------------------------------------------|
| HYBRIDMOE_NATIVE  | 0 turns the native C kernels off (torch's kernels do the work)      |
| HYBRIDMOE_QUANT_ISA | the quantised kernels' path: avx512, avxvnni, avx2 or off (default: |
|                   | widest)                                                             |
| HYBRIDMOE_BF16_ISA | the bf16 kernels' build: avx512bf16, avx512f (its two bf16 instructions |
|                   | written out in AVX512F, as on CPUs without them), avx2 (every AVX-512 |
|                   | operation written out in AVX2 and FMA) or off (default: widest)     |
| HYBRIDMOE_AMX     | 0 keeps the AMX tiles off (decode attention, quantised prefill products) |
| HYBRIDMOE_API_KEY | the API key `serve` requires (instead of --api-key, which `ps` shows)   |
| CC                | the C compiler that builds them (default `cc`)                      |
| XDG_CACHE_HOME    | where the user cache directory lies (default ~/.cache)              |
| OMP_WAIT_POLICY   | set to PASSIVE unless given (see `set_defaults`)                     |
| MC_TCP_BIND_ADDRESS, MC_STORE_CLIENT_SETUP_RETRIES: set for Mooncake unless given            |
|                   | (`set_mooncake_defaults`)                                           |
"""

from __future__ import annotations

import os
from pathlib import Path


def native_enabled() -> bool:
    return os.environ.get("HYBRIDMOE_NATIVE", "1") != "0"


def quant_isa() -> str | None:
    return os.environ.get("HYBRIDMOE_QUANT_ISA")


def bf16_isa() -> str | None:
    return os.environ.get("HYBRIDMOE_BF16_ISA")


def amx_enabled() -> bool:
    return os.environ.get("HYBRIDMOE_AMX", "1") != "0"


def api_key() -> str | None:
    return os.environ.get("HYBRIDMOE_API_KEY") or None


def c_compiler() -> str:
    return os.environ.get("CC") or "cc"


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def omp_wait_policy() -> str | None:
    return os.environ.get("OMP_WAIT_POLICY")


_DEFAULTED: set[str] = set()  # what set_defaults set (the user had not)


def set_defaults() -> None:
    """OpenMP threads that finish a parallel region first spin-wait for the others by default; when
    the cores are shared with other processes, the thread they wait for is often descheduled and the
    spin burns the time it needed (docs/notes/2026-11-24-measurements-in-code.md,
    "OMP_WAIT_POLICY"). OpenMP reads the variable once, when torch loads it, so this runs when
    hybridmoe is imported, before torch (the CLI); a value the user set is kept."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _DEFAULTED.add("OMP_WAIT_POLICY")


def without_defaults() -> dict[str, str]:
    """This environment less what set_defaults added: for a process of another program
    (bench generate's llama.cpp), which runs as its own users run it."""
    return {k: v for k, v in os.environ.items() if k not in _DEFAULTED}


def drop_defaults() -> None:
    """Undo set_defaults in this process, before a peer's libraries load (bench/engine_worker)."""
    for key in _DEFAULTED:
        os.environ.pop(key, None)


def set_mooncake_defaults(host: str) -> None:
    """Mooncake's transfer engine advertises the first network interface it finds unless told an
    address; a prefix-cache client must be reached at `host`, the one its URL names. Joining a
    master that is down is tried once (about 5 s, not Mooncake's 20 s and more): the remote tier
    tries again after its back-off. Values the user set are kept."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
