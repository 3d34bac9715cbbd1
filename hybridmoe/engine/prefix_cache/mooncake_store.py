"""Mooncake Store as the shared tier, through the mooncake-transfer-engine package's
`MooncakeDistributedStore`, over TCP.

    --prefix-cache-remote mooncake://MASTER_HOST:PORT[?metadata=URL&local_hostname=HOST]

The master (`mooncake_master`, with its HTTP metadata server or another one at `metadata`, by
default http://MASTER_HOST:8080/metadata) and the memory that holds the blocks (`mooncake_client
--global_segment_size=...`, a process of its own) run apart from the servers: a server contributes
no memory of its own, so a replica that stops or crashes takes no block with it. `local_hostname` is
the address the other Mooncake processes reach this one at (default 127.0.0.1 when the master is on
this machine, else this host's name).
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import parse_qs, urlsplit

from hybridmoe import env
from hybridmoe.errors import UserError

_BUFFER = 64 << 20  # this client's transfer buffer: a batch of blocks must fit (tuning.py)


def mooncake_settings(url: str) -> dict:
    """The store's setup values from a mooncake:// URL."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise UserError(
            f"--prefix-cache-remote {url}: give the master as mooncake://HOST:PORT, like "
            "mooncake://127.0.0.1:50051"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    loopback = parts.hostname in ("127.0.0.1", "localhost", "::1")
    return {
        "master": f"{parts.hostname}:{parts.port}",
        "metadata": query.get("metadata", f"http://{parts.hostname}:8080/metadata"),
        "local_hostname": query.get(
            "local_hostname", "127.0.0.1" if loopback else socket.gethostname()
        ),
    }


class MooncakeStore:
    """Joins the master at its first use, on the remote tier's threads: a master that is down or
    slow to answer (setup retries for many seconds) delays no start and fails no request."""

    def __init__(self, url: str):
        self.url, self.settings = url, mooncake_settings(url)
        env.set_mooncake_defaults(self.settings["local_hostname"])
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise UserError(
                f"--prefix-cache-remote {url} needs Mooncake ({e}); pip install "
                "'hybridmoe[mooncake]' and apt-get install libibverbs1"
            ) from None
        self._new = MooncakeDistributedStore
        self._store = None
        self._lock = threading.Lock()

    @property
    def store(self):
        with self._lock:
            if self._store is None:
                s, store = self.settings, self._new()
                rc = store.setup(
                    s["local_hostname"], s["metadata"], 0, _BUFFER, "tcp", "", s["master"]
                )
                if rc != 0:
                    raise ConnectionError(
                        f"cannot join the Mooncake master at {s['master']} with metadata at "
                        f"{s['metadata']} (error {rc})"
                    )
                self._store = store
            return self._store

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [v or None for v in self.store.get_batch(keys)]  # tuning.REMOTE_BATCH_BLOCKS

    def put(self, key: str, data: bytes) -> None:
        rc = self.store.put(key, data)
        if rc != 0:
            raise RuntimeError(f"Mooncake put failed (error {rc})")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
