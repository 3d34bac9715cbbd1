"""Redis or Valkey as the shared tier (`--prefix-cache-remote redis://HOST:PORT/DB`).

Give the server a memory limit and an eviction policy (`maxmemory 8gb`, `maxmemory-policy
allkeys-lru`): the blocks are a cache, and Redis then drops the least recently used ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hybridmoe.errors import UserError


class RedisStore:
    def __init__(self, url: str, timeout: float):
        try:
            import redis
        except ImportError:
            raise UserError(
                f"--prefix-cache-remote {url} needs the redis client; "
                "pip install 'hybridmoe[redis]'"
            ) from None
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self._timeout_error = redis.exceptions.TimeoutError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._timeouts():
            return self.client.mget(keys)

    def put(self, key: str, data: bytes) -> None:
        with self._timeouts():
            self.client.set(key, data, nx=True)  # blocks never change: the first write stands

    @contextmanager
    def _timeouts(self) -> Iterator[None]:
        """The client's socket timeout (the tier's own, which may fire before the tier's wait does)
        as Python's TimeoutError, which the tier counts as a timeout, not as an error."""
        try:
            yield
        except self._timeout_error as e:
            raise TimeoutError(str(e)) from e

    def close(self) -> None:
        self.client.close()
