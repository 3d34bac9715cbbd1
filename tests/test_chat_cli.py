"""`hybridmoe chat` as users run it: piped replies each end with a newline, and Ctrl-C during a
reply stops that reply, not the chat."""

import signal
import subprocess
import sys
import threading
import time

from tests.console import ROOT, hybridmoe


def test_piped_replies_are_one_per_line(tiny_chat_model):
    run = hybridmoe(
        "chat", "--model", tiny_chat_model, "--threads", "1", "--max-tokens", "5",
        input="Hello\nAnd again\n", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    replies = run.stdout.removeprefix("> ").split("\n> ")
    assert len(replies) == 3 and replies[-1].strip() == ""  # two replies, then the empty prompt
    assert all(r.endswith("\n") or "\n" not in r for r in replies[:2])
    assert run.stderr.count("[5 tokens") == 2


def test_ctrl_c_during_a_reply_stops_it_and_the_chat_goes_on(tiny_chat_model):
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridmoe", "chat", "--model", str(tiny_chat_model),
         "--threads", "1", "--max-tokens", "900"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out = bytearray()

    def read():
        while byte := proc.stdout.read(1):
            out.extend(byte)

    reader = threading.Thread(target=read)
    reader.start()
    proc.stdin.write(b"Tell me a long story\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while len(out) < 40:  # the reply is streaming
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.stdin.write(b"/reset\nShort one\n")
    proc.stdin.close()
    assert proc.wait(120) == 0
    reader.join(10)
    err = proc.stderr.read().decode()
    assert "[stopped, " in err and "Traceback" not in err
    assert err.count(" tok/s]") == 2  # the stopped reply, then the next one in full
