"""`hybridmoe bench first-run`: the README's main job as on a fresh machine once `pip install` has
ended: `hybridmoe generate --chat --prompt "What is the capital of France?"` with an empty user
cache (XDG_CACHE_HOME pointing to a new temporary folder), so that the demo model is built and the
native kernels are compiled before the answer. Reports, per run and as medians, the seconds from
the command's start to the answer's first byte and to its end, with the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
COMMAND = ["generate", "--chat", "--prompt", QUESTION]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "first-run",
        help="the README's main job with an empty cache: seconds to the first answer",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--runs", type=int, default=3, help="runs, each with a fresh cache")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one_run() -> dict:
    """One first run in a fresh cache: seconds to the answer's first byte and to the end, the
    answer, the build's notice and what the built model's hybridmoe_demo.json says."""
    with tempfile.TemporaryDirectory(prefix="hybridmoe-first-run-") as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONUNBUFFERED": "1"}
        log = Path(cache) / "stderr.txt"
        with open(log, "wb") as err:
            start = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "hybridmoe", *COMMAND],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
            first = proc.stdout.read(1)
            first_s = time.perf_counter() - start
            answer = first + proc.stdout.read()
            code = proc.wait()
            end_s = time.perf_counter() - start
        stderr = log.read_text(errors="replace")
        if code != 0:
            raise RuntimeError(f"the first run exited {code}:\n{stderr[-2000:]}")
        built = list(Path(cache, "hybridmoe").glob("demo-smollm2-*/hybridmoe_demo.json"))
        return {
            "first_answer_s": round(first_s, 2),
            "end_s": round(end_s, 2),
            "answer": answer.decode(errors="replace").strip(),
            "notice": [line for line in stderr.splitlines() if "building the demo model" in line],
            "demo": json.loads(built[0].read_text()) if built else None,
        }


def run(args) -> int:
    before = loadavg()
    runs = [one_run() for _ in range(args.runs)]
    result = {
        "runs": runs,
        "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs),
        "median_end_s": statistics.median(r["end_s"] for r in runs),
        "loadavg_before": before,
        "loadavg_after": loadavg(),
    }
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    lines = ["| run | first answer (s) | end (s) | downs |", "|---|---|---|---|"]
    for i, r in enumerate(result["runs"], 1):
        downs = (r["demo"] or {}).get("downs", "?")
        lines.append(f"| {i} | {r['first_answer_s']:.1f} | {r['end_s']:.1f} | {downs} |")
    lines.append(
        f"| median | **{result['median_first_answer_s']:.1f}** | {result['median_end_s']:.1f} | |"
    )
    lines += [
        "",
        f"load average before {result['loadavg_before']}, after {result['loadavg_after']}",
        f"notice: {result['runs'][0]['notice']}",
        f"answer: {result['runs'][0]['answer']!r}",
    ]
    return "\n".join(lines)
