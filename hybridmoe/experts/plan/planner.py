"""The per-layer planner: for each routed expert, CPU, GPU from the cache, or GPU after a copy.

Call sequence (the engine's hybrid runtime and the simulator make exactly these calls):

    planner = make_planner(...)
    for each step (one forward pass of the batch):
        planner.begin_step()
        for each MoE layer, in model order:
            routed = [Routed(expert, n_tokens, weight), ...]    # one per distinct expert selected
            plan = planner.plan(layer, routed, now=clock_seconds, predicted=scores_or_None)
            # the accelerator and the CPU side, all started at `now`:
            #   copy stream: for c in plan.copies + plan.prefetches, in that order:
            #       wait until the GPU has finished with c.evicted (its last use was an earlier
            #       layer), copy expert (c.layer, c.expert) into slot c.slot (None = a staging
            #       buffer that is not kept), record an event for it.
            #   GPU:  plan.gpu_hits now; each of plan.gpu_copied after its copy's event
            #         (the copy may have been issued by an earlier plan's prefetches).
            #   CPU:  plan.cpu on the worker pool, at the same time.
            planner.complete(plan, finished_at=clock_seconds_when_all_done)   # or None: predicted

Build it with `make_planner(cost, layers, num_experts, top_k, slots, make_policy(name), stats,
placement_kind, profile)` (cost: `CostModel.for_expert(shape, quant)`; slots:
`cache.parse_budget(...)`; stats: an `ExpertStats` from `stats.read_stats(FILE)` or None; profile:
routed steps to learn from before planning, the simulator's fair protocol).

`predicted` is the next MoE layer's router applied to this layer's input (per-expert
probabilities, or None); the planner hands it to the predictor. Every decision mutates the cache at
plan time (slots are assigned to copies immediately, usable from their `ready` time). `complete`
records measured time; the simulator passes None (its clock is the cost model). `stats` holds the
run's counters (hits, misses, copies, bytes, prefetches issued/used, makespan predicted/measured).

Objective per layer: makespan = max(CPU finish, GPU finish), where a GPU expert that needs a copy
waits for it, minus the value (seconds of expected future saving, from the policy) of what the
copies leave in the cache. Experts whose copy is in flight are ordered by readiness, misses by
CPU time saved; every pair of prefixes (a of the first, b of the second go to the GPU) is tried
and the best kept (list scheduling on two resources; within 10% of brute force in the tests).
Then the policy's background candidates (admissions, prefetches) are queued on the copy stream
while it is idle, or its backlog ends `policy.background_slack` copies before this layer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridmoe.experts.plan.cache import ExpertCache, placement
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.predictor import Predictor, PredictorStats
from hybridmoe.experts.plan.shape import Key
from hybridmoe.experts.plan.stats import ExpertStats


@dataclass(frozen=True)
class Routed:
    expert: int
    n_tokens: int = 1
    weight: float = 1.0  # router weight (summed over the tokens), for score-keeping policies


@dataclass(frozen=True)
class Copy:
    layer: int
    expert: int
    slot: int | None  # None: a staging buffer, not kept in the cache (Fiddler)
    evicted: Key | None
    start: float
    ready: float


@dataclass
class Plan:
    layer: int
    now: float
    cpu: list[Routed] = field(default_factory=list)
    gpu_hits: list[Routed] = field(default_factory=list)
    gpu_copied: list[Routed] = field(default_factory=list)  # run on the GPU once their copy is done
    ready: dict[int, float] = field(
        default_factory=dict
    )  # expert -> copy completion, for gpu_copied
    copies: list[Copy] = field(default_factory=list)  # demand copies, for this layer
    prefetches: list[Copy] = field(default_factory=list)  # background copies, for later use
    cpu_finish: float = 0.0
    gpu_finish: float = 0.0

    @property
    def makespan(self) -> float:
        """Absolute time at which the layer's experts are all done (predicted)."""
        return max(self.now, self.cpu_finish, self.gpu_finish)


@dataclass
class PlannerStats:
    steps: int = 0
    layers: int = 0
    routed: int = 0
    hits: int = 0  # resident and ready
    late_hits: int = 0  # resident but the copy still in flight
    misses: int = 0
    cpu_runs: int = 0
    gpu_runs: int = 0
    demand_copies: int = 0
    prefetches_issued: int = 0
    prefetches_used: int = 0
    bytes_copied: float = 0.0
    cpu_busy_s: float = 0.0
    gpu_busy_s: float = 0.0
    copy_busy_s: float = 0.0
    predicted_s: float = 0.0  # sum of predicted layer makespans
    measured_s: float = 0.0  # sum of measured ones (0 when nobody measured)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.routed if self.routed else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetches_used / self.prefetches_issued if self.prefetches_issued else 0.0


@dataclass
class PlannerConfig:
    value_weight: float = 1.0  # seconds of cache value per second of makespan in the objective
    layer_time_alpha: float = 0.1  # EMA of layer durations, for "will this copy arrive in time"


class Planner:
    def __init__(
        self,
        cost: CostModel,
        cache: ExpertCache,
        policy,
        predictor: Predictor,
        config: PlannerConfig | None = None,
    ):
        self.cost, self.cache, self.policy, self.predictor = cost, cache, policy, predictor
        self.config = config or PlannerConfig()
        self.layers = predictor.layers
        self.ordinal = predictor.ordinal
        self.copy_free = 0.0  # when the copy stream has finished everything queued
        self.layer_time = 0.0  # EMA of layer makespans
        self.step = -1  # steps begun (begin_step), from 0
        self.position = 0  # step * L + ordinal of the layer being planned
        self._prefetched: set[Key] = set()
        self._late = 0
        self.epoch = 0  # bumped whenever policy scores may change (policies cache rankings by it)
        self.stats = PlannerStats()
        self.uses_gpu = policy.uses_gpu and cost.has_gpu
        policy.bind(self)

    # ---- the calls ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step (one forward pass of the batch) begins: its layers are planned next, in order."""
        self.step += 1
        self.stats.steps += 1
        self.predictor.begin_step()

    def plan(self, layer: int, routed: list[Routed], now: float, predicted=None) -> Plan:
        self.epoch += 1
        self._locate(layer)
        self._take_prediction(layer, predicted)
        plan = Plan(layer=layer, now=now)
        hits, late, misses = self._classify(layer, routed, now, plan)
        # Learn this layer's routing before splitting it, so that a copy's worth (and a victim's)
        # is judged by the layer's *next* visit, and the look-ahead to later layers is fresh.
        self.predictor.observe(layer, [r.expert for r in routed])
        if not self.uses_gpu:
            plan.cpu, plan.gpu_hits = hits + late + misses, []
        else:
            self._split(layer, late, misses, now, plan)
        self._schedule(plan)
        self.policy.on_use(layer, routed, now)
        self.epoch += 1
        if self.uses_gpu:
            self._background(layer, now, plan)
        self._count(plan, routed)
        return plan

    def observe_only(self, layer: int, routed: list[Routed]) -> None:
        """Learn from a layer's routing without planning it (the profile part of a trace)."""
        self._locate(layer)
        self.epoch += 1
        self.policy.on_use(layer, routed, 0.0)
        self.predictor.observe(layer, [r.expert for r in routed])

    def complete(self, plan: Plan, finished_at: float | None = None) -> None:
        span = plan.makespan - plan.now
        measured = span if finished_at is None else finished_at - plan.now
        if finished_at is not None:
            self.stats.measured_s += measured
        a = self.config.layer_time_alpha
        self.layer_time = (
            measured if self.layer_time == 0 else (1 - a) * self.layer_time + a * measured
        )

    # ---- helpers for policies ----------------------------------------------------------------
    def distance(self, layer: int) -> int:
        """MoE layers from the one being planned until `layer` runs next (1..L; L = itself)."""
        L = len(self.layers)
        d = (self.ordinal[layer] - self.position % L) % L
        return d or L

    def protected(self, now: float, plan: Plan) -> set[Key]:
        """Keys no copy may evict now: used on the GPU by this plan, or still being copied."""
        keys = {(plan.layer, r.expert) for r in plan.gpu_hits + plan.gpu_copied}
        keys.update(k for k, t in self.cache.ready_at.items() if t > now)
        return keys

    # ---- steps of plan() ---------------------------------------------------------------------
    def _locate(self, layer: int) -> None:
        self.position = self.step * len(self.layers) + self.ordinal[layer]

    def _take_prediction(self, layer: int, predicted) -> None:
        o = self.ordinal[layer]
        if predicted is not None and o + 1 < len(self.layers):
            self.predictor.set_router_scores(self.layers[o + 1], predicted)

    def _classify(self, layer, routed, now, plan):
        hits, late, misses = [], [], []
        for r in routed:
            key = (layer, r.expert)
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.prefetches_used += 1
            if self.cache.is_ready(key, now):
                hits.append(r)
            elif key in self.cache:
                late.append(r)
            else:
                misses.append(r)
        plan.gpu_hits = hits
        self._late = len(late)
        return hits, late, misses

    def _split(self, layer, late, misses, now, plan) -> None:
        """Choose which late/missed experts go to the GPU; issue their copies."""
        rule = self.policy.copy_rule
        movable = sorted(late, key=lambda r: self.cache.ready_at[(layer, r.expert)])
        if rule == "none":
            options = [(r, None, 0.0) for r in movable]
        elif rule == "threshold":  # Fiddler: per expert, copy if copy + GPU beats the CPU
            fast = [
                r
                for r in misses
                if self.cost.t_copy() + self.cost.t_gpu(r.n_tokens) < self.cost.t_cpu(r.n_tokens)
            ]
            options = [(r, None, 0.0) for r in movable] + [(r, "copy", 0.0) for r in fast]
        else:
            options = [(r, None, 0.0) for r in movable] + self._copy_options(
                layer, misses, now, plan
            )
        if rule == "threshold":
            chosen = options
        else:
            chosen = self._best_split(plan, options[: len(movable)], options[len(movable) :], now)
        gpu = {r.expert for r, _, _ in chosen}
        plan.cpu = [r for r in movable + misses if r.expert not in gpu]
        for r, how, _ in chosen:
            if how is not None:
                self._issue(layer, r.expert, how, now, plan.copies)
            plan.ready[r.expert] = self.cache.ready_at.get(
                (layer, r.expert), plan.copies[-1].ready if how else now
            )
            plan.gpu_copied.append(r)

    def _copy_options(self, layer, misses, now, plan) -> list[tuple]:
        """Misses that could be copied, biggest CPU saving first, each with its victim and gain."""
        protect = self.protected(now, plan) | {(layer, r.expert) for r in misses}
        free = self.cache.free_count()
        out = []
        # Biggest CPU saving first; among equals (decode: all one token) the policy's favourite.
        order = sorted(
            misses,
            key=lambda r: (
                -self.cost.t_cpu(r.n_tokens),
                -self.policy.copy_priority((layer, r.expert)),
            ),
        )
        for r in order:
            key = (layer, r.expert)
            ok, victim = self.policy.make_room(key, protect, now, free)
            if not ok:
                break
            if victim is None:
                free -= 1
            else:
                protect.add(victim)
            gain = self.config.value_weight * self.policy.admit_gain(key, victim, now)
            out.append((r, ("evict", victim), gain))
        return out

    def _best_split(self, plan: Plan, late, copies, now) -> list:
        """Which leading late experts (soonest ready first) and leading copy options (biggest CPU
        saving first) to run on the GPU: the pair of prefixes minimising makespan - value."""
        best, best_cost = [], math.inf
        for a in range(len(late) + 1):
            for b in range(len(copies) + 1):
                gpu = late[:a] + copies[:b]
                cpu = [r for r, _, _ in late[a:] + copies[b:]]
                cost = self._makespan(plan, cpu, gpu, now) - sum(g for _, _, g in gpu)
                if cost < best_cost - 1e-12:
                    best, best_cost = gpu, cost
        return best

    def _makespan(self, plan: Plan, cpu, gpu_options, now) -> float:
        c = self.cost
        cpu_end = now + sum(c.t_cpu(r.n_tokens) for r in cpu)
        if cpu:
            cpu_end += c.t_act(max(r.n_tokens for r in cpu))
        gpu_end = now + sum(c.t_gpu(r.n_tokens) for r in plan.gpu_hits)
        copy_t, readies = max(now, self.copy_free), []
        for r, how, _ in gpu_options:
            if how is None:
                readies.append((self.cache.ready_at[(plan.layer, r.expert)], r.n_tokens))
            else:
                copy_t += c.t_copy()
                readies.append((copy_t, r.n_tokens))
        for ready, n in sorted(readies):  # the GPU takes copied experts as they arrive
            gpu_end = max(gpu_end, ready) + c.t_gpu(n)
        return max(cpu_end, gpu_end)

    def _issue(self, layer: int, expert: int, how, now: float, out: list[Copy]) -> Copy:
        """Queue one copy on the copy stream and record it in the cache."""
        start = max(now, self.copy_free)
        ready = start + self.cost.t_copy()
        self.copy_free = ready
        key, victim, slot = (layer, expert), None, None
        if how != "copy" and self.policy.keeps_copies:
            victim = how[1]
            if victim is not None:
                self._prefetched.discard(victim)
            slot = self.cache.insert(key, ready, evict=victim)
            self.policy.on_insert(key, victim, now)
        copy = Copy(layer, expert, slot, victim, start, ready)
        out.append(copy)
        self.stats.bytes_copied += self.cost.expert_bytes
        self.stats.copy_busy_s += ready - start
        return copy

    def _schedule(self, plan: Plan) -> None:
        """Predicted finish times of the chosen split (the same arithmetic as _makespan)."""
        c, now = self.cost, plan.now
        plan.cpu_finish = now + sum(c.t_cpu(r.n_tokens) for r in plan.cpu)
        if plan.cpu:
            plan.cpu_finish += c.t_act(max(r.n_tokens for r in plan.cpu))
        t = now + sum(c.t_gpu(r.n_tokens) for r in plan.gpu_hits)
        for r in sorted(plan.gpu_copied, key=lambda r: plan.ready[r.expert]):
            t = max(t, plan.ready[r.expert]) + c.t_gpu(r.n_tokens)
        plan.gpu_finish = t

    def _background(self, layer: int, now: float, plan: Plan) -> None:
        """Copies the policy wants for later (admissions, prefetches)."""
        # An idle stream always takes one; a busy one only while its backlog ends `slack` copies
        # before this layer does (so the next layer's demand copies do not queue behind it).
        end = plan.makespan - self.policy.background_slack * self.cost.t_copy()
        if self.copy_free > now and self.copy_free >= end:
            return
        protect = self.protected(now, plan)
        for key in self.policy.background(layer, now, plan):
            if self.copy_free > now and self.copy_free >= end:
                break
            if key in self.cache or key in protect:
                continue
            ok, victim = self.policy.make_room(key, protect, now, self.cache.free_count())
            if not ok or not self.policy.worth(key, victim, now):
                continue
            self._issue(key[0], key[1], ("evict", victim), now, plan.prefetches)
            protect.add(key)
            self._prefetched.add(key)
            self.stats.prefetches_issued += 1

    def _count(self, plan: Plan, routed: list[Routed]) -> None:
        s, c = self.stats, self.cost
        s.layers += 1
        s.routed += len(routed)
        s.hits += len(plan.gpu_hits)
        s.late_hits += self._late
        s.misses += len(routed) - len(plan.gpu_hits)
        s.cpu_runs += len(plan.cpu)
        s.gpu_runs += len(plan.gpu_hits) + len(plan.gpu_copied)
        s.demand_copies += len(plan.copies)
        s.cpu_busy_s += plan.cpu_finish - plan.now if plan.cpu else 0.0
        s.gpu_busy_s += sum(c.t_gpu(r.n_tokens) for r in plan.gpu_hits + plan.gpu_copied)
        s.predicted_s += plan.makespan - plan.now


def make_planner(
    cost: CostModel,
    layers: list[int],
    num_experts: int,
    top_k: int,
    slots: int,
    policy,
    stats: ExpertStats | None = None,
    placement_kind: str | None = None,
    profile=(),
    config: PlannerConfig | None = None,
) -> Planner:
    """A planner with its cache placed and its policy and predictor warm: the one way to build one,
    for the engine's runtime and the simulator alike.

    `policy` is a Policy object (policies.make_policy). `stats` (activation statistics from a file)
    warm the predictor and the policy and order the placement. `profile`: routed steps (per step, a
    list per MoE layer of Routed) to learn from first, in order; their counts stand in for `stats`
    when none are given, and the predictor is scored only on what comes after them.
    """
    cache = ExpertCache(slots if policy.uses_gpu and cost.has_gpu else 0)
    predictor = Predictor(layers, num_experts, top_k, cross_layer=policy.cross_layer)
    planner = Planner(cost, cache, policy, predictor, config)
    if stats is not None:
        predictor.warm_start(stats.counts, stats.tokens)
    placed_by = (
        stats
        if stats is not None or not profile
        else ExpertStats.of_steps(profile, layers, num_experts)
    )
    if placed_by is not None:
        policy.warm_start(placed_by)
    for step in profile:
        planner.begin_step()
        for layer, routed in zip(layers, step):
            planner.observe_only(layer, routed)
    place(planner, placement_kind, placed_by)
    predictor.stats = PredictorStats()
    return planner


def place(planner: Planner, kind: str | None, stats: ExpertStats | None) -> None:
    """Fill the cache at start: pinned for static policies, a warm start for dynamic ones. Without
    statistics, frequency placement (the default) leaves a dynamic policy's cache to fill as it
    goes, and spreads a static set evenly over the layers."""
    policy, cache = planner.policy, planner.cache
    if kind is None:
        kind = "uniform" if stats is None and policy.pin_placement else policy.default_placement
    if cache.slots == 0 or (kind == "frequency" and stats is None and not policy.pin_placement):
        return
    keys = placement(kind, cache.slots, planner.layers, planner.predictor.num_experts, stats)
    cache.place(keys, pinned=policy.pin_placement)
