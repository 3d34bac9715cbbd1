"""What one MoE layer takes on the simulated machine, beyond what the planner predicted.

The planner's cost model times each expert on an idle machine; here the layer also pays:

- shared DRAM bandwidth: while the copy stream's DMA reads host memory (at `bw_pcie`), the CPU
  experts' streaming gets only what DRAM has left (`bw_dram - bw_pcie`), so they slow down in
  proportion to the share of their time that is streaming;
- a per-layer synchronisation between the CPU and the GPU (`c_sync`) whenever experts ran on the
  CPU: the GPU waits for their result;
- expert deferral (KTransformers, SOSP'25): in decode, the `defer` CPU experts of lowest router
  weight of each layer but the last are added to the next layer's output instead, so the CPU
  works on them while the GPU runs the next layer's attention; the next layer's CPU experts start
  after them, and it cannot end before they do.

Copies and GPU experts keep the planner's times: the copy engine is served first.
"""

from __future__ import annotations

from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.planner import Plan


class Machine:
    def __init__(self, cost: CostModel, defer: int = 0):
        self.cost, self.defer = cost, defer
        self.copying: list[tuple[float, float]] = []  # copy-stream busy intervals, in order
        self.cpu_free = 0.0  # when the CPU is done with the previous layer's deferred experts

    def layer(self, plan: Plan, now: float, last: bool) -> float:
        """When `plan`'s layer is done, started at `now`; `last`: the step's last MoE layer."""
        c = self.cost
        for copy in plan.copies + plan.prefetches:
            self._copying(copy.start, copy.ready)
        end = max(now, plan.gpu_finish if (plan.gpu_hits or plan.gpu_copied) else now)
        cpu = sorted(plan.cpu, key=lambda r: -r.weight)
        deferred = cpu[len(cpu) - self.defer :] if self.defer and not last else []
        now_cpu = cpu[: len(cpu) - len(deferred)]
        start = max(now, self.cpu_free)
        if now_cpu:
            done = self._run(start, now_cpu)
            end = max(end, done + c.t_act(sum(r.n_tokens for r in now_cpu), plan.tokens))
        else:
            done = start
            end = max(end, self.cpu_free)  # the previous layer's deferred work lands here
        if plan.cpu and c.has_gpu:
            end += c.c_sync
        self.cpu_free = self._run(done, deferred) if deferred else done
        return end

    def _run(self, start: float, routed) -> float:
        """When the CPU finishes `routed` begun at `start`, slowed while copies stream."""
        c = self.cost
        work = sum(c.t_cpu(r.n_tokens) for r in routed)
        if not (c.bw_dram and c.has_gpu) or work <= 0:
            return start + work
        stream = min(work, len(routed) * c.expert_bytes / c.bw_cpu)
        left = max(c.bw_dram - c.bw_pcie, 0.0)
        share = min(1.0, left / c.bw_cpu)  # streaming speed beside a copy, relative
        slow = stream / work / max(share, 1e-9) + (1.0 - stream / work)  # time per unit of work
        t = start
        for a, b in self.copying:
            if b <= t:
                continue
            if a > t:  # an idle stretch first
                if t + work <= a:
                    return t + work
                work -= a - t
                t = a
            span = (b - t) / slow  # work done while this copy runs
            if work <= span:
                return t + work * slow
            work -= span
            t = b
        return t + work

    def _copying(self, start: float, end: float) -> None:
        if self.copying and start <= self.copying[-1][1]:
            a, b = self.copying[-1]
            self.copying[-1] = (a, max(b, end))
        else:
            self.copying.append((start, end))
        if len(self.copying) > 256:  # old intervals are never asked about again
            del self.copying[:128]
