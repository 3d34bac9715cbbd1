"""Imports point one way: server -> engine -> models -> layers -> experts -> quant -> native, and
sim -> experts/plan.
Inside experts/, run/ (tensors) imports plan/ (pure logic), never the reverse, and plan/ and sim/
work without torch: the simulator and the planner install and run on a machine without it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridmoe"
# What each package must not import: everything above it (and, for sim/, the tensor wing).
FORBIDDEN = {
    "experts": {"layers", "models", "engine", "server", "sim", "cli", "bench", "demo"},
    "layers": {"models", "engine", "server", "sim", "cli", "bench"},
    "models": {"engine", "server", "sim", "cli", "bench"},
    "engine": {"server", "sim", "cli", "bench"},
    "sim": {
        "layers",
        "models",
        "engine",
        "server",
        "cli",
        "bench",
        "experts.run",
        "native",
        "loader",
    },
    "experts/plan": {"experts.run", "native", "loader", "layers", "models"},
    "quant": {
        "experts",
        "layers",
        "models",
        "engine",
        "server",
        "sim",
        "cli",
        "bench",
        "demo",
        "loader",
    },
    # export writes files from checkpoints: it runs no model
    "export": {"experts", "layers", "models", "engine", "server", "sim", "cli", "bench", "demo"},
    "native": {"quant", "experts", "layers", "models", "engine", "server", "sim", "cli", "bench"},
}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, as dotted names (hybridmoe.X.Y, torch, ...)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def imported_packages(path: Path) -> set[str]:
    """The hybridmoe sub-packages that `path` imports (hybridmoe.X.Y... -> X and X.Y)."""
    out = set()
    for name in imported_modules(path):
        parts = name.split(".")
        if parts[0] == "hybridmoe" and len(parts) > 1:
            out.add(parts[1])
            if len(parts) > 2:
                out.add(".".join(parts[1:3]))
    return out


# Modules of a forbidden package that a package may import all the same: the planner's C kernels
# (native/predictor_kernels.py, native/split_kernels.py over native/build.py), which import neither
# torch nor anything above the planner (checked below, and by importing every planning module
# without torch).
ALLOWED = {"experts/plan": {"hybridmoe.native.predictor_kernels", "hybridmoe.native.split_kernels"}}


def forbidden_imports(path: Path, package: str) -> set[str]:
    allowed = ALLOWED.get(package, set())
    found = set()
    for name in imported_modules(path) - allowed:
        found |= imported_packages_of(name) & FORBIDDEN[package]
    return found


def imported_packages_of(name: str) -> set[str]:
    parts = name.split(".")
    if parts[0] != "hybridmoe" or len(parts) < 2:
        return set()
    return {parts[1]} | ({".".join(parts[1:3])} if len(parts) > 2 else set())


def test_the_allowed_native_modules_import_only_the_torch_free_build():
    for modules in ALLOWED.values():
        for name in modules:
            path = ROOT / (name.replace(".", "/") + ".py")
            inner = {m for m in imported_modules(path) if m.split(".")[0] in ("hybridmoe", "torch")}
            assert inner <= {"hybridmoe.native.build"}, (name, inner)
    build = {m for m in imported_modules(PACKAGE / "native" / "build.py") if "torch" in m}
    assert not build


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_one_above_it(package):
    wrong = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = forbidden_imports(path, package)
        if bad:
            wrong[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"imports pointing upward: {wrong}"


def test_the_planning_wing_and_the_simulator_name_no_torch():
    wrong = {
        str(p.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(p) if m.split(".")[0] == "torch"
        )
        for folder in ("experts/plan", "sim")
        for p in sorted((PACKAGE / folder).rglob("*.py"))
    }
    assert not {k: v for k, v in wrong.items() if v}


# Run with torch unimportable: a None entry in sys.modules makes `import torch` raise ImportError.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def test_every_module_of_plan_and_sim_imports_without_torch(tmp_path):
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for folder in ("experts/plan", "sim")
        for p in sorted((PACKAGE / folder).rglob("*.py"))
    ]
    done = run_without_torch(
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint('ok')", tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_simulate_and_plan_run_without_torch(tmp_path):
    trace = tmp_path / "t.jsonl"
    code = (
        "from hybridmoe.cli import main\n"
        "assert main(['simulate', '--synthetic', 'tokens=40,seed=1', '--model-shape', "
        f"'olmoe-1b-7b', '--no-oracle', '--write-trace', {str(trace)!r}]) == 0\n"
        "assert main(['plan', '--hardware', 'rtx4090-ddr5', '--model-shape', 'olmoe-1b-7b']) == 0\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
    )
    done = run_without_torch(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stdout and trace.exists()
