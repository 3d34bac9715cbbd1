"""The demo model's cache: a truncated or corrupt build is seen as incomplete (and rebuilt with a
message), and what interrupted builds left behind is deleted by the next one."""

import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

from hybridmoe.demo.build import WEIGHTS, is_complete, remove_stale


def fake_build(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file({"a": torch.ones(64, 64), "b": torch.zeros(10)}, str(path / WEIGHTS))
    return path


def test_a_whole_build_is_complete_and_a_damaged_one_is_not(tmp_path):
    good = fake_build(tmp_path / "good")
    assert is_complete(good)
    size = (good / WEIGHTS).stat().st_size
    for name, damage in {
        "truncated": lambda f: os.truncate(f, size - 100),
        "longer": lambda f: open(f, "ab").write(b"x"),
        "garbage header": lambda f: open(f, "r+b").write(b"\xff" * 16),
        "empty": lambda f: os.truncate(f, 0),
    }.items():
        path = fake_build(tmp_path / name.replace(" ", "-"))
        damage(path / WEIGHTS)
        assert not is_complete(path), name
    (good / "config.json").unlink()
    assert not is_complete(good)


def test_a_killed_builds_folders_are_removed_and_a_running_ones_kept(tmp_path):
    out = tmp_path / "demo-model"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead = int(gone.stdout)
    left = [tmp_path / f".demo-model.tmp-{dead}", tmp_path / f".demo-model.old-{dead}"]
    running = tmp_path / f".demo-model.tmp-{os.getpid()}"
    other = tmp_path / f".other-model.tmp-{dead}"
    for d in [*left, running, other]:
        d.mkdir()
        (d / "part").write_bytes(b"half a model")
    remove_stale(out)
    assert not any(d.exists() for d in left)
    assert running.exists() and other.exists()
