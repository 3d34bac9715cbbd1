"""The look-ahead hint of recorded traces (trace_format "ahead": the next layers' routers applied
to a layer's input): how well it names the experts the next layers pick, and the per-step hint the
simulator hands the planner, as the engine's runtime does (`HybridRuntime._predict_next`: the mean
over the step's rows of the next layer's router probabilities). Traces without it (OLMoE-1B-7B's,
any public trace of expert ids) give None: the hint exists only where a model recorded it."""

from __future__ import annotations

import numpy as np

from hybridmoe.experts.plan.trace_format import TraceLine


def has_hint(lines: list[TraceLine]) -> bool:
    return all(line.ahead is not None for line in lines)


def step_hints(steps: list[list[TraceLine]]) -> list[list[np.ndarray | None]]:
    """Per step (the lines it decodes) and MoE layer o, the mean of the lines' layer o + 1 router
    probabilities on layer o's input [E]; None for the last layer, or where a line has no hint."""
    out = []
    for group in steps:
        n_layers = len(group[0].layers)
        if not all(line.ahead is not None for line in group):
            out.append([None] * n_layers)
            continue
        row = []
        for o in range(n_layers):
            if not group[0].ahead[o]:
                row.append(None)
                continue
            probs = np.array([line.ahead[o][0] for line in group])  # [B, E]
            row.append(probs.mean(axis=0))
        out.append(row)
    return out


def hint_recall(lines: list[TraceLine], h: int, top_k: int | None = None) -> float:
    """The share of the experts each layer o + h used that the top-k of its hint from layer o (the
    router of layer o + h on layer o's input) named, over every token and layer with one. Ties in
    the hint go to the lower expert id (a stable sort, as the predictor ranks)."""
    named = total = 0
    for line in lines:
        if line.ahead is None:
            continue
        for o, horizons in enumerate(line.ahead):
            if len(horizons) < h:
                continue
            used = line.layers[o + h]
            k = top_k or len(used)
            top = np.argsort(-np.asarray(horizons[h - 1]), kind="stable")[:k]
            named += len(set(top.tolist()) & set(used))
            total += len(used)
    return named / total if total else float("nan")
