"""The first run before and after shipping the demo model's fit, alternated (docs/benchmarks.md,
"First run"): three rounds of one run of the branch point's tree (d407732, whose build fitted the
down projections) and one of this tree, each with an empty XDG_CACHE_HOME, through `bench
first-run`'s one_run(). The branch point's tree is a plain export:
`git archive d407732 | tar -x -C /tmp/fr/base`. Run, from a folder without a hybridmoe package:
`flock /tmp/hybridmoe-heavy.lock python /path/to/repo/docs/notes/2026-11-24-first-run-ab.py`."""

import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from hybridmoe.bench.first_run import loadavg, one_run  # noqa: E402

TREES = (("before d407732", "/tmp/fr/base"), ("after", str(REPO)))
out = {"loadavg_before": loadavg(), "runs": []}
for _ in range(3):
    for name, path in TREES:
        os.environ["PYTHONPATH"] = path  # the child `python -m hybridmoe` imports this tree
        r = one_run()
        r.update(variant=name, loadavg=loadavg())
        out["runs"].append(r)
        print(json.dumps({k: r[k] for k in ("variant", "first_answer_s", "end_s", "loadavg")}))
for name, _ in TREES:
    runs = [r for r in out["runs"] if r["variant"] == name]
    out[name] = {
        "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs),
        "median_end_s": statistics.median(r["end_s"] for r in runs),
    }
out["loadavg_after"] = loadavg()
print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
