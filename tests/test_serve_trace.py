"""`hybridmoe serve --record-trace FILE`: concurrent requests are recorded under their own ids, line
by line as they decode, so that even a killed server leaves a readable trace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.trace_format import read_trace
from tests.served_model import tiny_chat_model
from tests.services import free_port

MAX_TOKENS = 6


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


@pytest.fixture
def server(tmp_path):
    """A real `hybridmoe serve` process recording a trace; killed (SIGKILL) at the end."""
    calibration = tmp_path / "cost.json"
    PROFILES["this-machine-2core"].save(calibration)  # no calibration run in the test
    trace, port = tmp_path / "trace.jsonl", free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybridmoe",
        "serve",
        "--model",
        str(tiny_chat_model()),
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--threads",
        "1",
        "--calibration",
        str(calibration),
        "--record-trace",
        str(trace),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ}
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        yield url, proc, trace
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def complete(url: str, prompt: str) -> dict:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


def test_a_killed_server_leaves_each_concurrent_request_recorded_under_its_id(server):
    url, proc, trace = server
    with ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(lambda p: complete(url, p), ["Once upon a time", "The capital of France"])
        )
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in answers), answers
    proc.send_signal(signal.SIGKILL)  # no shutdown: what is in the file was written as it decoded
    proc.wait(timeout=30)
    lines = read_trace(trace)  # every line parses: none was cut
    by_request = {}
    for line in lines:
        by_request.setdefault(line.req, []).append(line)
    assert len(by_request) == 2, sorted(by_request)
    for req, rows in by_request.items():
        assert len(rows) == MAX_TOKENS - 1, req  # the first token comes from the prompt's step
        assert all(len(ids) == 2 for row in rows for ids in row.layers)  # 2 MoE layers, top-2
