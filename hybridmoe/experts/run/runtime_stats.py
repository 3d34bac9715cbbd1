"""What an expert runtime did, per step and in total: `model.runtime.stats`, an observer that
every runtime keeps (runtime.py).

Each layer reports its counters (FIELDS): the planner's (hits, misses, copies, bytes, prefetches
issued and used, predicted makespan) as differences around the layer, and what only the runtime
measures (CPU time of its experts, GPU time of the accelerator, the layer's time). A step's
counters stay in its `Step` until it ends, so that two passes on two threads never mix.
"""

from __future__ import annotations

import threading
from collections import deque

# Counters taken from PlannerStats (summed per step).
PLANNER_FIELDS = (
    "routed",
    "hits",
    "late_hits",
    "misses",
    "cpu_runs",
    "gpu_runs",
    "demand_copies",
    "prefetches_issued",
    "prefetches_used",
    "bytes_copied",
    "predicted_s",
)
# Counters only the runtime knows.
MEASURED_FIELDS = ("layers", "tokens", "cpu_busy_s", "gpu_busy_s", "copy_busy_s", "measured_s")
FIELDS = PLANNER_FIELDS + MEASURED_FIELDS


def _blank() -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0)


def derived(c: dict) -> dict:
    """Rates from counters: hit rate, prefetch precision, predicted/measured, busy fractions."""
    measured = c["measured_s"]
    return {
        "hit_rate": c["hits"] / c["routed"] if c["routed"] else 0.0,
        "prefetch_precision": c["prefetches_used"] / c["prefetches_issued"]
        if c["prefetches_issued"]
        else 0.0,
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
        self.history: deque[dict] = deque(maxlen=history)  # finished steps, newest last
        self.predictor = (
            None  # an object with .precision and .recall (the planner's predictor's stats)
        )
        self._lock = threading.Lock()

    # ---- the observer ------------------------------------------------------------------------
    def begin_step(self, step) -> None:
        step.notes[self] = {**_blank(), "tokens": step.num_tokens}

    def on_layer(self, step, ordinal, topk_ids, topk_weights, report: dict, hint=None) -> None:
        current = step.notes[self]
        for f, v in report.items():
            current[f] += v
        current["layers"] += 1

    def end_step(self, step) -> None:
        current = step.notes.pop(self)
        with self._lock:
            self.steps += 1
            self.history.append({**current, **derived(current)})
            for f, v in current.items():
                self.total[f] += v

    def close(self) -> None:
        """Nothing to write: the totals stay readable."""

    # ---- reading -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Totals and rates, flat (what a /metrics endpoint exports)."""
        p = self.predictor
        return {
            "device": self.device,
            "policy": self.policy,
            "slots": self.slots,
            "steps": self.steps,
            **self.total,
            **derived(self.total),
            "predictor_precision": p.precision if p else 0.0,
            "predictor_recall": p.recall if p else 0.0,
        }

    def summary(self) -> str:
        d = self.to_dict()
        return "\n".join(
            [
                f"expert runtime: {d['device']}, policy {d['policy']}, {d['slots']} GPU slots, "
                f"{d['steps']} steps, {int(d['tokens'])} tokens",
                f"  experts: {int(d['routed'])} routed, {int(d['hits'])} hits "
                f"({100 * d['hit_rate']:.1f}%), {int(d['misses'])} misses; ran "
                f"{int(d['cpu_runs'])} on CPU, {int(d['gpu_runs'])} on GPU",
                f"  copies: {int(d['demand_copies'])} on demand, {int(d['prefetches_issued'])} "
                f"prefetches ({int(d['prefetches_used'])} used, precision "
                f"{100 * d['prefetch_precision']:.0f}%), {d['bytes_copied'] / 1e6:.1f} MB",
                f"  time: measured {1e3 * d['measured_s']:.1f} ms ({d['expert_ms_per_token']:.2f} "
                f"ms/token), predicted {1e3 * d['predicted_s']:.1f} ms; CPU busy "
                f"{1e3 * d['cpu_busy_s']:.1f} ms, GPU busy {1e3 * d['gpu_busy_s']:.1f} ms, copy "
                f"stream {1e3 * d['copy_busy_s']:.1f} ms",
                f"  predictor: precision {100 * d['predictor_precision']:.0f}%, recall "
                f"{100 * d['predictor_recall']:.0f}%",
            ]
        )
