"""Servers the prefix-cache tests start on 127.0.0.1 and stop: Redis (or Valkey) and Mooncake's
master (with its HTTP metadata server) and store. A missing binary or package fails the test with
what to install."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hybridmoe import env


def _ephemeral_low() -> int:
    """The lowest port the kernel gives to outgoing connections (and to `bind(0)`)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed: set[int] = set()


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on, for a server started next. It is drawn from below
    the kernel's ephemeral range, where no client connection of the tests (httpx to another server)
    can take it before the server binds it, and never the same one twice in a process, so servers
    started one after another before any of them listens do not collide."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range on 127.0.0.1")


def wait_port(port: int, proc: subprocess.Popen, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on {port}")


@contextlib.contextmanager
def running(args: list[str], port: int, env: dict | None = None, log: Path | None = None):
    """`args` as a process of its own, until it listens on `port`; killed at exit."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_port(port, proc)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if log:
            out.close()


@contextlib.contextmanager
def redis_server():
    """A fresh Redis (or Valkey) on a free port, in memory only: yields (url, process)."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        pytest.fail("no redis-server or valkey-server: apt-get install -y redis-server")
    if importlib.util.find_spec("redis") is None:
        pytest.fail("no redis client: pip install -e '.[test]'")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with running(args, port) as proc:
        yield f"redis://127.0.0.1:{port}/0", proc


def mooncake_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None:
        pytest.fail("no Mooncake: pip install -e '.[test]' (mooncake-transfer-engine-non-cuda)")
    return Path(spec.submodule_search_locations[0])


@contextlib.contextmanager
def mooncake_store(segment: str = "256MB"):
    """Mooncake's master with its HTTP metadata server, and a store process holding `segment` of
    memory for blocks, on free ports of 127.0.0.1: yields the mooncake:// URL servers are given."""
    bin_dir = mooncake_dir()
    rpc, meta, metrics, client = free_port(), free_port(), free_port(), free_port()
    logs = Path(tempfile.mkdtemp(prefix="hybridmoe-mooncake-"))
    penv = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    master = [
        str(bin_dir / "mooncake_master"),
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={meta}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ]
    metadata = f"http://127.0.0.1:{meta}/metadata"
    store = [
        str(bin_dir / "mooncake_client"),
        "--host=127.0.0.1",
        f"--port={client}",
        f"--global_segment_size={segment}",
        f"--master_server_address=127.0.0.1:{rpc}",
        f"--metadata_server={metadata}",
        "--protocol=tcp",
    ]
    with (
        running(master, rpc, penv, logs / "master.log"),
        running(store, client, penv, logs / "store.log"),
    ):
        wait_segment(rpc, metadata)
        yield f"mooncake://127.0.0.1:{rpc}?metadata={metadata}"
    shutil.rmtree(logs, ignore_errors=True)


def wait_segment(rpc: int, metadata: str, seconds: float = 20.0) -> None:
    """Until the store's memory is mounted: a put from a client of our own succeeds."""
    env.set_mooncake_defaults("127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{rpc}") == 0
    deadline = time.monotonic() + seconds
    try:
        while s.put("hybridmoe:probe", b"x") != 0:
            assert time.monotonic() < deadline, "the Mooncake store mounted no memory"
            time.sleep(0.1)
    finally:
        s.close()
