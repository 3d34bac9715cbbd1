"""A directory of block files: one file per block, DIR/ab/abcdef....kvb, named by its key.

Every file is written whole or not at all (files.write_atomic: a temporary name, fsync, rename), so
a process killed at any moment leaves either the whole block or a stray temporary file, which the
next start removes. The index (key -> size, least recently used first) lives in memory and is
rebuilt from the directory at start, oldest modification first; reads refresh a file's time, so
the order survives restarts. Files that are not ours are skipped with a warning naming them, and a
block that fails verification on read (codec.py) is deleted with a warning naming it: never served,
never a crash. Several processes may share a directory: each keeps its own index and treats a file
another one removed as a miss.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from hybridmoe.engine.prefix_cache.identity import KEY_BYTES
from hybridmoe.engine.prefix_cache.tier import TierStats
from hybridmoe.files import write_atomic

log = logging.getLogger("hybridmoe.prefix_cache")

SUFFIX = ".kvb"
_NAME = re.compile(rf"[0-9a-f]{{{2 * KEY_BYTES}}}\{SUFFIX}")
_TEMP = re.compile(r"\..*\.tmp-.*")
_STALE_TEMP_S = 60.0  # older temporary files belong to a writer that died; younger may be live


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path, capacity: int):
        self.root, self.capacity = Path(root), capacity
        self.stats = TierStats()
        self.used = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, least recent first
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    # ---- the index ----
    def _rebuild(self) -> None:
        found = []
        for entry in sorted(self.root.iterdir()):
            if not (entry.is_dir() and re.fullmatch(r"[0-9a-f]{2}", entry.name)):
                log.warning("prefix cache: skipping %s: not a block directory", entry)
                continue
            for f in entry.iterdir():
                item = self._scan(entry, f)
                if item:
                    found.append(item)
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used += size
        self._evict()

    def _scan(self, parent: Path, f: Path) -> tuple[float, bytes, int] | None:
        try:
            st = f.stat()
        except OSError:
            return None  # removed meanwhile by another process
        if _TEMP.fullmatch(f.name):
            if time.time() - st.st_mtime > _STALE_TEMP_S:
                f.unlink(missing_ok=True)  # a write that was cut short
            return None
        if not (f.is_file() and _NAME.fullmatch(f.name) and f.name.startswith(parent.name)):
            log.warning("prefix cache: skipping %s: not a block file", f)
            return None
        return st.st_mtime, bytes.fromhex(f.name[: -len(SUFFIX)]), st.st_size

    def _evict(self) -> None:
        while self.used > self.capacity and self._index:
            key, size = self._index.popitem(last=False)
            self.used -= size
            self.path(key).unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        self.used -= size or 0

    # ---- the Tier protocol ----
    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        found = []
        for key in keys:
            with self._lock:
                if key not in self._index:
                    break
                self._index.move_to_end(key)
            data = self._read(key)
            if data is None:
                break
            found.append(data)
        return found

    def _read(self, key: bytes) -> bytearray | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
            os.utime(path)  # most recently used, for the order the next start rebuilds
        except FileNotFoundError:  # another process evicted it
            with self._lock:
                self._forget(key)
            return None
        except OSError as e:
            self.stats.errors += 1
            log.warning("prefix cache: cannot read %s (%s); computing instead", path, e)
            return None
        return data[:n]

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            if key in self._index:
                return
        write_atomic(self.path(key), data)
        with self._lock:
            if key not in self._index:
                self._index[key] = len(data)
                self.used += len(data)
            self._evict()
        self.stats.writes += 1
        self.stats.bytes_written += len(data)

    def reject(self, key: bytes, why: str) -> None:
        path = self.path(key)
        log.warning("prefix cache: skipping %s: %s; deleted it", path, why)
        self.stats.errors += 1
        path.unlink(missing_ok=True)
        with self._lock:
            self._forget(key)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        pass
