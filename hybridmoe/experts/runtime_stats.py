"""What the hybrid runtime did, per step and in total: `model.runtime.stats`.

Counters of the plans are the planner's own (experts/planner.py PlannerStats: hits, misses,
copies, bytes, prefetches issued and used, predicted makespan), taken as differences around each
layer so that nothing is counted twice; the runtime adds what only it can measure: CPU time of
the worker pool, GPU time of the accelerator, and the measured layer time.
"""

from __future__ import annotations

from collections import deque

# Counters taken from PlannerStats (summed per step).
PLANNER_FIELDS = (
    "routed", "hits", "late_hits", "misses", "cpu_runs", "gpu_runs", "demand_copies",
    "prefetches_issued", "prefetches_used", "bytes_copied", "predicted_s",
)
# Counters only the runtime knows.
MEASURED_FIELDS = ("layers", "tokens", "cpu_busy_s", "gpu_busy_s", "copy_busy_s", "measured_s")
FIELDS = PLANNER_FIELDS + MEASURED_FIELDS


def _blank() -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0)


DERIVED = ("hit_rate", "prefetch_precision", "predicted_over_measured", "cpu_busy_fraction", "gpu_busy_fraction",
           "expert_ms_per_token")


def derived(c: dict) -> dict:
    """Rates from counters: hit rate, prefetch precision, predicted/measured, busy fractions."""
    measured = c["measured_s"]
    return {
        "hit_rate": c["hits"] / c["routed"] if c["routed"] else 0.0,
        "prefetch_precision": c["prefetches_used"] / c["prefetches_issued"] if c["prefetches_issued"] else 0.0,
        "predicted_over_measured": c["predicted_s"] / measured if measured else 0.0,
        "cpu_busy_fraction": c["cpu_busy_s"] / measured if measured else 0.0,
        "gpu_busy_fraction": c["gpu_busy_s"] / measured if measured else 0.0,
        "expert_ms_per_token": 1e3 * measured / c["tokens"] if c["tokens"] else 0.0,
    }


class RuntimeStats:
    def __init__(self, device: str, policy: str, slots: int, history: int = 256):
        self.device, self.policy, self.slots = device, policy, slots
        self.steps = 0
        self.total = _blank()
        self.current = _blank()  # the step in progress
        self.history: deque[dict] = deque(maxlen=history)  # finished steps, newest last
        self.predictor = {"precision": 0.0, "recall": 0.0}

    def begin_step(self, tokens: int) -> None:
        self.end_step()
        self.current["tokens"] = tokens
        self.total["tokens"] += tokens

    def end_step(self) -> None:
        if self.current["layers"]:
            self.steps += 1
            self.history.append({**self.current, **derived(self.current)})
        self.current = _blank()

    def add_layer(self, before: dict, after: dict, measured: dict) -> None:
        """before/after: the planner's counters around one layer; measured: MEASURED_FIELDS values."""
        delta = {f: after[f] - before[f] for f in PLANNER_FIELDS}
        delta.update(measured, layers=1)
        for f, v in delta.items():
            self.current[f] += v
            self.total[f] += v

    def last_step(self) -> dict | None:
        return self.history[-1] if self.history else None

    def to_dict(self) -> dict:
        """Totals and rates, flat (what a /metrics endpoint exports)."""
        return {"device": self.device, "policy": self.policy, "slots": self.slots, "steps": self.steps,
                **self.total, **derived(self.total),
                "predictor_precision": self.predictor["precision"], "predictor_recall": self.predictor["recall"]}

    def summary(self) -> str:
        d = self.to_dict()
        return "\n".join([
            f"expert runtime: {d['device']}, policy {d['policy']}, {d['slots']} GPU slots, "
            f"{d['steps']} steps, {int(d['tokens'])} tokens",
            f"  experts: {int(d['routed'])} routed, {int(d['hits'])} hits ({100 * d['hit_rate']:.1f}%), "
            f"{int(d['misses'])} misses; ran {int(d['cpu_runs'])} on CPU, {int(d['gpu_runs'])} on GPU",
            f"  copies: {int(d['demand_copies'])} on demand, {int(d['prefetches_issued'])} prefetches "
            f"({int(d['prefetches_used'])} used, precision {100 * d['prefetch_precision']:.0f}%), "
            f"{d['bytes_copied'] / 1e6:.1f} MB",
            f"  time: measured {1e3 * d['measured_s']:.1f} ms ({d['expert_ms_per_token']:.2f} ms/token), "
            f"predicted {1e3 * d['predicted_s']:.1f} ms; CPU busy {1e3 * d['cpu_busy_s']:.1f} ms, "
            f"GPU busy {1e3 * d['gpu_busy_s']:.1f} ms, copy stream {1e3 * d['copy_busy_s']:.1f} ms",
            f"  predictor: precision {100 * d['predictor_precision']:.0f}%, recall {100 * d['predictor_recall']:.0f}%",
        ])


# Every total and rate is also an attribute (stats.hits, stats.hit_rate), so that readers that walk
# an object's numeric properties, such as the server's /metrics, see them all.
for _name in FIELDS:
    setattr(RuntimeStats, _name, property(lambda self, f=_name: self.total[f]))
for _name in DERIVED:
    setattr(RuntimeStats, _name, property(lambda self, f=_name: derived(self.total)[f]))
RuntimeStats.predictor_precision = property(lambda self: self.predictor["precision"])
RuntimeStats.predictor_recall = property(lambda self: self.predictor["recall"])
