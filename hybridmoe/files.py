"""Files written whole or not at all: a temporary file beside the target, fsynced, then renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader, or a run killed midway, never sees half of it."""
    with atomic_path(path, mode=0o666) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_path(path: str | Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path beside `path` to write to; when the block ends without an exception, the
    file is fsynced, given `mode` (less the umask) and renamed to `path`, else removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, mode & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
