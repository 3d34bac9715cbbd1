"""`hybridmoe serve` as a process of its own, as users run it: started on a free port of
127.0.0.1, asked over HTTP, stopped or killed."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.console import ROOT
from tests.services import free_port


class ServeProcess:
    def __init__(self, model: Path, *flags: str):
        self.args = ["--model", str(model), "--threads", "1", *flags]
        self.log = Path(tempfile.mkstemp(prefix="hybridmoe-serve-", suffix=".log")[1])
        self.retries = 3  # a port taken between free_port() and the server's bind: another one
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridmoe", "serve", *self.args, "--port", str(self.port)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, seconds: float = 120.0) -> ServeProcess:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()
                if "cannot listen on" in log and self.retries > 0:
                    self.retries -= 1
                    self._start()
                    continue
                raise RuntimeError(f"hybridmoe serve exited:\n{log[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"hybridmoe serve did not start:\n{self.log.read_text()[-3000:]}")

    def complete(self, prompt: list[int], max_tokens: int = 4, timeout: float = 120) -> dict:
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"hybridmoe_{name}{{")]
        return float(line.rsplit(" ", 1)[1])

    def wait_written(self, seconds: float = 60.0) -> None:
        """Until the blocks handed to the prefix cache's tiers are written."""
        deadline = time.monotonic() + seconds
        while self.metric("prefix_cache_write_queue_blocks") > 0:
            assert time.monotonic() < deadline, "the write-back queue did not drain"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServeProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
