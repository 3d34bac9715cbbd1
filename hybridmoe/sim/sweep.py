"""Policies x budgets x hardware profiles through the simulator: a table and a PNG plot."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.oracle import belady_min_hit_rate, future_of
from hybridmoe.sim.shapes import ModelShape
from hybridmoe.sim.simulator import SimConfig, SimResult, build, simulate

DEFAULT_POLICIES = ("cpu", "static", "fiddler", "hybrimoe", "lru", "lfu", "value", "oracle")


@dataclass
class Row:
    result: SimResult
    oracle: SimResult
    min_hit_rate: float  # Belady MIN, free copies: the bound on hit rate

    @property
    def pct_of_oracle_speed(self) -> float:
        return 100.0 * self.oracle.expert_ms_per_token / self.result.expert_ms_per_token

    @property
    def pct_of_min_hit_rate(self) -> float:
        return 100.0 * self.result.hit_rate / self.min_hit_rate if self.min_hit_rate else 0.0


def min_hit_rate(lines, shape: ModelShape, cost, cfg: SimConfig) -> float:
    """Belady's MIN from the same warm start as the frequency placement."""
    planner, _, _, start = build(
        lines, shape, cost, SimConfig(**{**cfg.__dict__, "policy": "value"})
    )
    initial = list(planner.cache.slot_of)
    return belady_min_hit_rate(
        future_of(lines, shape, cfg.batch), planner.cache.slots, start, initial
    )


def compare(lines, shape: ModelShape, cost, cfg: SimConfig, policies) -> list[Row]:
    """Each policy with the oracle and the MIN bound of the same budget."""
    oracle = simulate(lines, shape, cost, SimConfig(**{**cfg.__dict__, "policy": "oracle"}))
    bound = min_hit_rate(lines, shape, cost, cfg)
    rows = []
    for name in policies:
        result = (
            oracle
            if name == "oracle"
            else simulate(lines, shape, cost, SimConfig(**{**cfg.__dict__, "policy": name}))
        )
        rows.append(Row(result, oracle, bound))
    return rows


def sweep(
    lines, shape: ModelShape, hardware: list[str], quant: str, budgets, policies, base: SimConfig
) -> list[Row]:
    rows = []
    for hw in hardware:
        cost = get_profile(hw).for_expert(shape.experts, quant)
        for budget in budgets:
            rows += compare(
                lines, shape, cost, SimConfig(**{**base.__dict__, "budget": budget}), policies
            )
    return rows


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'hardware':18s} {'budget':>6s} {'policy':9s} {'ms/tok':>7s} {'tok/s':>7s} "
        f"{'hit':>5s} {'copies':>6s} {'%oracle':>7s} {'%MIN hit':>8s}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        s = r.result
        out.append(
            f"{s.hardware:18s} {s.budget:>6s} {s.policy:9s} {s.expert_ms_per_token:7.3f} "
            f"{s.tokens_per_s:7.1f} {s.hit_rate:5.2f} {s.copies_per_token:6.1f} "
            f"{r.pct_of_oracle_speed:6.1f}% {r.pct_of_min_hit_rate:7.1f}%"
        )
    return "\n".join(out)


def plot(rows: list[Row], path: str, title: str = "", published=()) -> None:
    """tok/s against budget: one line per policy, the oracle dashed, one panel per hardware
    profile; `published` (sim/published.py rows of this model) marked where their machine has a
    panel, at their setting's budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hardware = list(dict.fromkeys(r.result.hardware for r in rows))
    fig, axes = plt.subplots(1, len(hardware), figsize=(5 * len(hardware), 4), squeeze=False)
    for ax, hw in zip(axes[0], hardware):
        mine = [r.result for r in rows if r.result.hardware == hw]
        for policy in dict.fromkeys(r.policy for r in mine):
            pts = sorted((float(r.budget), r.tokens_per_s) for r in mine if r.policy == policy)
            style = "k--" if policy == "oracle" else "-o"
            label = "oracle (knows the future)" if policy == "oracle" else policy
            ax.plot(
                [100 * b for b, _ in pts], [t for _, t in pts], style, label=label, markersize=3
            )
        for row in (r for r in published if r.hardware == hw):
            ax.plot(100 * float(row.budget), row.tok_s, "r*", markersize=12)
            ax.annotate(
                f"published {row.tok_s:g}\n({row.engine})",
                (100 * float(row.budget), row.tok_s),
                textcoords="offset points",
                xytext=(6, -4),
                fontsize=7,
                color="r",
            )
        ax.set_title(hw)
        ax.set_xlabel("GPU expert budget (% of expert bytes)")
        ax.set_ylabel("decode tok/s (simulated)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
