"""Building and loading the C kernels: CPU features from /proc/cpuinfo, the system C compiler at
first use, the shared library cached per source and flags in the user cache directory (written
atomically), and ctypes signatures declared beside the C prototypes they bind."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import types
from functools import cache, lru_cache
from pathlib import Path

from hybridmoe import env
from hybridmoe.paths import user_cache_dir

# ctypes types for the C prototypes: pointers and longs, as the kernels take them
P, N, F, INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


@cache
def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo (Linux); "" elsewhere or where it has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); elsewhere none."""
    return frozenset(_cpuinfo("flags").split())


def cpu_family() -> int:
    """The CPU's family number from /proc/cpuinfo (AMD: 25 for Zen 3 and 4, 26 for Zen 5); -1
    where unknown."""
    family = _cpuinfo("cpu family")
    return int(family) if family.isdigit() else -1


def cpu_vendor() -> str:
    """The CPU's vendor (GenuineIntel, AuthenticAMD, ...) from /proc/cpuinfo; "" elsewhere."""
    return _cpuinfo("vendor_id")


def cpu_is_amd() -> bool:
    """Whether the CPU is AMD's: some kernels ask for their data another way there (bf16.py,
    quant.py, each with its measurements)."""
    return cpu_vendor() == "AuthenticAMD"


def far_hint_flag() -> str:
    """bf16.c's and quant.c's FAR_HINT: how one-token products ask for their weights 4-8 KB ahead.
    Non-temporal on AMD's Zen 5 (family 26), where the products read as fast or faster so (Q4_K
    4096 x 2048 from RAM 34.5 -> 37.2 GB/s) and the Python between two kernels finds more of its
    lines in the caches (the 4-layer Q4_K_M file's decode ~4% faster a token at one thread, 15-25%
    at two; the demo's 4% and 12%: docs/notes/2026-12-07-attention-prefetch.md); into L2 elsewhere
    (Zen 4 and Intel's cores unmeasured)."""
    nta = cpu_is_amd() and cpu_family() == 26
    return f"-DFAR_HINT={'_MM_HINT_NTA' if nta else '_MM_HINT_T1'}"


@cache
def assembles(instruction: str) -> bool:
    """Whether the C compiler's assembler takes `instruction` in extended inline assembly (GNU as
    takes AVX-VNNI's `{vex}` forms from binutils 2.36, 2021): kernels that need one are built
    without it where it does not, and their path is not offered (quant.py)."""
    cc = env.c_compiler()
    if shutil.which(cc) is None:
        return False
    try:  # a temporary folder that cannot be made, a compiler that fails to start: not taken
        with tempfile.TemporaryDirectory() as d:
            probe = Path(d) / "probe.c"
            probe.write_text(f'void probe(void) {{ __asm__ volatile("{instruction}" :::); }}\n')
            run = subprocess.run(
                [cc, "-c", str(probe), "-o", str(Path(d) / "probe.o")],
                capture_output=True,
                timeout=60,
            )
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0


def _compile(source: Path, flags: list[str], out: Path) -> None:
    """cc FLAGS source -o out, through a temporary file in out's directory and a rename."""
    cc = env.c_compiler()
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(source: Path, flags: list[str], headers: tuple[Path, ...] = ()) -> Path:
    """Where `load` keeps `source` built with `flags`: named by a hash of the sources and flags."""
    text = b"".join(p.read_bytes() for p in (source, *headers))
    key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    return user_cache_dir() / "native" / f"{source.stem}-{key}.so"


def load(
    source: Path,
    flags: list[str],
    signatures: dict[str, tuple[list, object]],
    headers: tuple[Path, ...] = (),
) -> types.SimpleNamespace | None:
    """`source` (which includes `headers`) compiled with `flags` (once, then from the cache): its
    functions named in `signatures` (name -> (argument types, result type)), typed, as the
    attributes of the result (no other); None where the native
    kernels are switched off (HYBRIDMOE_NATIVE=0) or no compiler can build them."""
    if not env.native_enabled():
        return None
    path = library_path(source, flags, headers)
    try:
        if not path.exists():
            _compile(source, flags, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    typed = {}
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
        typed[name] = fn
    # only the typed functions: ctypes would call an undeclared one with every argument as a C int,
    # cutting pointers to 32 bits
    return types.SimpleNamespace(**typed)


def switch(lib, setter: str, state: list[bool], on: bool, permitted) -> bool:
    """Tell a library's on/off flag (its C function `setter`) `on`, but on only where the library
    runs and `permitted()` (say, Linux granted the AMX tiles); state[0] keeps what it was told.
    Returns whether it is on now."""
    on = bool(on and lib is not None and permitted())
    if lib is not None:
        getattr(lib, setter)(int(on))
        state[0] = on
    return on
