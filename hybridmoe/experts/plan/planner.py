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
and the best kept (list scheduling on two resources; within 5% of a brute force over every subset
on the named hardware profiles, tests/test_planner.py). Misses the cache has no room for stay on
the CPU, and are charged there, with the activation round trip of the CPU experts' rows
(CostModel.t_act: what the hybrid runtime moves). That search runs in C where a compiler built it
(native/split.c), with the same bits and ties as its Python reference (`_best_split_reference`).
Then the policy's background candidates (admissions, prefetches) are queued on the copy stream
while it is idle, or its backlog ends `policy.background_slack` copies before this layer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

import hybridmoe.native.split_kernels as split_kernels
from hybridmoe import tuning
from hybridmoe.experts.plan.cache import ExpertCache, placement
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.predictor import ROUTER_TOP, Predictor, PredictorStats
from hybridmoe.experts.plan.ranked import Ranked
from hybridmoe.experts.plan.shape import Key
from hybridmoe.experts.plan.stats import ExpertStats


@dataclass(frozen=True)
class Routed:
    expert: int
    n_tokens: int = 1
    weight: float = 1.0  # router weight (summed over the tokens), for score-keeping policies


class Copy(NamedTuple):  # immutable, and made a dozen times a plan: quicker than a frozen dataclass
    layer: int
    expert: int
    slot: int | None  # None: a staging buffer, not kept in the cache (valid for its layer only)
    evicted: Key | None
    start: float
    ready: float


class _Times:
    """A cost model's per-expert times, memoised by token count (the planner asks for the same few
    counts thousands of times a step)."""

    def __init__(self, cost: CostModel):
        self.cost, self._cpu, self._gpu = cost, {}, {}
        self.copy = cost.t_copy()
        self.slowdown = cost.copy_slowdown()
        self.tokens = 1  # the layer being planned's token rows (for the activation round trip)
        # CostModel.t_act's terms: seconds per row crossing the bus, and per layer (two copies).
        self._row = cost.hidden * cost.act_bytes / cost.bw_pcie if cost.has_gpu else 0.0
        self._fixed = 2.0 * cost.c_act if cost.has_gpu else 0.0
        self.native = self._bind() if cost.has_gpu else None  # the split in C (split.c)

    def _bind(self):
        lib = split_kernels.library()
        if lib is None:
            return None
        constants = {"t_copy": self.copy, "slowdown": self.slowdown, "row": self._row}
        constants.update(fixed=self._fixed, late_subsets=tuning.LATE_SUBSETS)
        return split_kernels.Split(lib, self.cpu, self.gpu, constants)

    def cpu_beside_copies(self, work: float, copying: float) -> float:
        """Seconds `work` seconds of CPU experts take when copies stream for the first
        `copying` seconds (DRAM shared with their DMA)."""
        slow = self.slowdown
        if copying <= 0 or slow == 1.0:
            return work
        if work * slow <= copying:
            return work * slow
        return work + copying * (1.0 - 1.0 / slow)

    def cpu(self, n: int) -> float:
        t = self._cpu.get(n)
        if t is None:
            t = self._cpu[n] = self.cost.t_cpu(n)
        return t

    def gpu(self, n: int) -> float:
        t = self._gpu.get(n)
        if t is None:
            t = self._gpu[n] = self.cost.t_gpu(n)
        return t

    def cpu_all(self, counts: list[int]) -> list[float]:
        """`cpu` of each count (the memo read directly: a schedule asks for dozens)."""
        return _each(self._cpu, self.cpu, counts)

    def gpu_all(self, counts: list[int]) -> list[float]:
        """`gpu` of each count."""
        return _each(self._gpu, self.gpu, counts)

    def act(self, rows: int) -> float:
        """The activation round trip of CPU experts taking `rows` token rows in all
        (CostModel.t_act, without a call or a memo: sums of rows take too many values to keep)."""
        if not rows:
            return 0.0
        return (min(rows, self.tokens) + rows) * self._row + self._fixed


def _each(memo: dict, one, counts: list[int]) -> list[float]:
    """one(n) for each count, read from its memo where every count is there already."""
    try:
        return [memo[n] for n in counts]
    except KeyError:
        return [one(n) for n in counts]


@dataclass(slots=True)  # not frozen: made a few times per plan, and frozen ones init slowly
class _Option:
    """One way to run a missed expert on the GPU: its copy and what that leaves in the cache."""

    routed: Routed
    how: object  # ("evict", victim or None): admitted to the cache; "stage": a staging buffer
    gain: float  # seconds of cache value the copy leaves (value_weight included)


@dataclass
class Plan:
    layer: int
    now: float
    tokens: int = 1  # the layer's token rows
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
        self.times = _Times(cost)
        self.config = config or PlannerConfig()
        self.layers = predictor.layers
        self.ordinal = predictor.ordinal
        self.copy_free = 0.0  # when the copy stream has finished everything queued
        self.layer_time = 0.0  # EMA of layer makespans
        # EMA of the time between one layer's end and the next one's plan (its dense part,
        # planning): the copy stream works on through it.
        self.gap = 0.0
        self._last_end: float | None = None
        self.step = -1  # steps begun (begin_step), from 0
        self.position = 0  # step * L + ordinal of the layer being planned
        self._prefetched: set[Key] = set()
        self._late = 0
        self._distances = (None, None)
        self._unprepared = None  # (plan, routed) of a plan(defer=True) not yet prepared
        self.epoch = 0  # bumped whenever policy scores may change (policies cache rankings by it)
        self.stats = PlannerStats()
        self.uses_gpu = policy.uses_gpu and cost.has_gpu
        cache.track(self.layers, predictor.num_experts)
        policy.bind(self)

    # ---- the calls ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step (one forward pass of the batch) begins: its layers are planned next, in order."""
        self.step += 1
        self.stats.steps += 1
        self.predictor.begin_step()

    def plan(
        self,
        layer: int,
        routed: list[Routed],
        now: float,
        predicted=None,
        defer: bool = False,
        tokens: int | None = None,
    ) -> Plan:
        """Where each of `routed` runs, and the copies that takes. With `defer`, only what the
        layer's experts wait for is done here, and the caller calls `prepare(plan, predicted)`
        once it has started them (and before the next plan): the planner's bookkeeping for the
        layers to come, and the plan's predicted finish times (`makespan`), then overlap this
        layer's work. `tokens`: the layer's token rows (default:
        the routed assignments over top_k, exact when every token takes top_k experts), which
        bound the activations sent to the CPU (CostModel.t_act)."""
        if self._unprepared is not None:
            raise RuntimeError("plan(defer=True) must be followed by prepare(plan)")
        if tokens is None:
            tokens = -(-sum([r.n_tokens for r in routed]) // self.predictor.top_k)
        self.times.tokens = tokens = max(tokens, 1)
        self.epoch += 1
        self._locate(layer)
        self._time_gap(now)
        plan = Plan(layer=layer, now=now, tokens=tokens)
        hits, late, misses = self._classify(layer, routed, now, plan)
        if not self.uses_gpu:  # nothing to predict for: everything runs on the CPU
            plan.cpu, plan.gpu_hits = hits + late + misses, []
        else:
            # The predictor counts this visit in prepare(); a policy that judges a copy's worth
            # (and a victim's) by the layer's *next* visit reads Predictor.after_visit.
            self._split(layer, late, misses, now, plan)
        self._unprepared = (plan, routed)
        if not defer:
            self.prepare(plan, predicted)
        return plan

    def prepare(self, plan: Plan, predicted=None) -> list[Copy]:
        """The rest of planning `plan`'s layer, which its experts do not wait for: the next
        layer's router scores (`predicted`), the cross-layer look-ahead, the policy's bookkeeping,
        and the background copies it wants (appended to plan.prefetches, and returned)."""
        if self._unprepared is None or self._unprepared[0] is not plan:
            raise RuntimeError("prepare(plan) takes the plan of the last plan() call, once")
        routed = self._unprepared[1]
        self._unprepared = None
        self._schedule(plan)  # before any background copy joins the stream
        self._count(plan, routed)
        if self.uses_gpu and self.policy.uses_predictor:
            # the visit, the next layer's router scores, the look-ahead and every probability
            # (no policy's on_use reads the predictor)
            self.predictor.visit(plan.layer, [r.expert for r in routed], predicted)
        self.policy.on_use(plan.layer, routed, plan.now)
        self.epoch += 1
        if self.uses_gpu:
            self._background(plan.layer, plan.now, plan)
            if self.policy.uses_predictor:
                self.predictor.matrices()  # every layer's probabilities, fresh for the next plan
            self.policy.prepare_next()
        return plan.prefetches

    def observe_only(self, layer: int, routed: list[Routed], predicted=None) -> None:
        """Learn from a layer's routing (and the next layer's router scores, `predicted`) without
        planning it (the profile part of a trace)."""
        self._locate(layer)
        self.epoch += 1
        self.policy.on_use(layer, routed, 0.0)
        self.predictor.observe(layer, [r.expert for r in routed])
        if self.policy.uses_predictor:
            self._take_prediction(layer, predicted)

    def complete(self, plan: Plan, finished_at: float | None = None) -> None:
        span = plan.makespan - plan.now
        measured = span if finished_at is None else finished_at - plan.now
        if finished_at is not None:
            self.stats.measured_s += measured
        a = self.config.layer_time_alpha
        self.layer_time = (
            measured if self.layer_time == 0 else (1 - a) * self.layer_time + a * measured
        )
        self._last_end = plan.now + measured

    def _time_gap(self, now: float) -> None:
        if self._last_end is None:
            return
        gap, a = max(0.0, now - self._last_end), self.config.layer_time_alpha
        self.gap = gap if self.gap == 0 else (1 - a) * self.gap + a * gap

    # ---- helpers for policies ----------------------------------------------------------------
    @property
    def layer_period(self) -> float:
        """Seconds from one layer's plan to the next one's: its experts, then the gap."""
        return self.layer_time + self.gap

    def distance(self, layer: int) -> int:
        """MoE layers from the one being planned until `layer` runs next (1..L; L = itself)."""
        L = len(self.layers)
        d = (self.ordinal[layer] - self.position % L) % L
        return d or L

    def distances(self, position: int | None = None) -> np.ndarray:
        """`distance` of every MoE layer, by ordinal [L], at this position (or `position`)."""
        position = self.position if position is None else position
        if self._distances[0] != position:
            L = len(self.layers)
            d = (np.arange(L) - position % L) % L
            self._distances = (position, np.where(d == 0, L, d))
        return self._distances[1]

    def protected(self, now: float, plan: Plan) -> set[Key]:
        """Keys no copy may evict now: used on the GPU by this plan, or still being copied."""
        keys, layer = self.cache.in_flight(now), plan.layer
        keys.update([(layer, r.expert) for r in plan.gpu_hits])
        keys.update([(layer, r.expert) for r in plan.gpu_copied])
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
        ready_at, prefetched = self.cache.ready_at, self._prefetched  # ready_at: every resident
        for r in routed:
            key = (layer, r.expert)
            if key in prefetched:
                prefetched.discard(key)
                self.stats.prefetches_used += 1
            ready = ready_at.get(key)
            if ready is None:
                misses.append(r)
            elif ready <= now:
                hits.append(r)
            else:
                late.append(r)
        plan.gpu_hits = hits
        self._late = len(late)
        return hits, late, misses

    def _split(self, layer, late, misses, now, plan) -> None:
        """Choose which late/missed experts go to the GPU; issue their copies."""
        # Soonest ready first; among equals the one that would take the CPU longest.
        movable = sorted(
            late,
            key=lambda r: (self.cache.ready_at[(layer, r.expert)], -self.times.cpu(r.n_tokens)),
        )
        if self.policy.copy_rule == "threshold":  # Fiddler: per expert, copy if copy + GPU wins
            tm = self.times
            chosen_late, chosen = (
                movable,
                [
                    _Option(r, "stage", 0.0)
                    for r in misses
                    if tm.copy + tm.gpu(r.n_tokens) < tm.cpu(r.n_tokens)
                ],
            )
        else:
            chosen_late, chosen = self._choose(layer, movable, misses, now, plan)
        gpu = {r.expert for r in chosen_late} | {o.routed.expert for o in chosen}
        plan.cpu = [r for r in movable + misses if r.expert not in gpu]
        for r in chosen_late:
            plan.ready[r.expert] = self.cache.ready_at[(layer, r.expert)]
            plan.gpu_copied.append(r)
        for o in chosen:
            copy = self._issue(layer, o.routed.expert, o.how, now, plan.copies)
            plan.ready[o.routed.expert] = copy.ready
            plan.gpu_copied.append(o.routed)

    def _choose(self, layer, late, misses, now, plan) -> tuple[list[Routed], list[_Option]]:
        """The best split over two orders of the misses: the most CPU time first (what a copy
        saves; on every real machine also the most tokens first), and where the GPU is relatively
        fastest first (the order in which the best split of work between two unrelated machines
        takes jobs; it differs only where the GPU is slower than the CPU for some token counts).
        Among equals (decode: all one token) the policy's favourite first."""
        tm, n = self.times, range(len(misses))
        unloved = [-x for x in self.policy.copy_priorities(layer, [r.expert for r in misses])]
        if len({r.n_tokens for r in misses}) < 2:  # decode at batch 1: one CPU time, one order
            orders = [sorted(n, key=unloved.__getitem__)]  # indices into misses
        else:
            cpu = [tm.cpu(r.n_tokens) for r in misses]
            ratio = [tm.gpu(r.n_tokens) / t for r, t in zip(misses, cpu)]
            orders = [sorted(n, key=lambda i: (-cpu[i], unloved[i]))]
            by_ratio = sorted(n, key=lambda i: (ratio[i], unloved[i]))
            if by_ratio != orders[0]:
                orders.append(by_ratio)
        best = None
        for order in orders:
            order = [misses[i] for i in order]
            options, stranded = self._copy_options(layer, order, now, plan)
            cost, chosen_late, b = self._best_split(plan, late, options, stranded, now)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, chosen_late, options[:b])
        return best[1], best[2]

    def _copy_options(self, layer, order, now, plan) -> tuple[list[_Option], list[Routed]]:
        """The misses in `order` that could be copied, each admitted to the cache (with its victim
        and gain) or staged in a buffer that is not kept; and those that can run only on the CPU.
        A copy is staged where the cache has no room, or where admitting it would cost more cache
        value than it leaves (the victim is likelier to be used)."""
        policy, weight = self.policy, self.config.value_weight
        tokens = sum([r.n_tokens for r in order]) / self.predictor.top_k
        stage, admit = policy.may_stage(tokens), policy.keeps_copies
        protect = self.protected(now, plan)
        protect.update([(layer, r.expert) for r in order])
        rooms = policy.rooms(layer, protect, now, self.cache.free_count()) if admit else iter(())
        room, gain_of = next(rooms, _NO_ROOM), policy.admit_gain_at(now)
        options, stranded = [], []
        for r in order:
            key, how, gain = (layer, r.expert), None, 0.0
            if room is not _NO_ROOM:  # a free slot (None) or a victim
                gain = weight * gain_of(key, room)
                if gain >= 0.0 or not stage:
                    how = ("evict", room)
                    room = next(rooms, _NO_ROOM)
            if how is None and stage:
                how, gain = "stage", 0.0
            if how is None:
                stranded.append(r)
            else:
                options.append(_Option(r, how, gain))
        return options, stranded

    def _best_split(self, plan: Plan, late, options, stranded, now) -> tuple[float, list, int]:
        """Which late experts and how many leading copy options run on the GPU: (makespan - value,
        the late ones, b) of the best choice. The stranded misses stay on the CPU whatever is
        chosen. In C where it is built (split.c: the same bits), else `_best_split_reference`."""
        native = self.times.native
        if native is not None:
            ready_at, layer, hits = self.cache.ready_at, plan.layer, plan.gpu_hits
            sizes = (len(hits), len(late), len(options), len(stranded))
            copied = [o.routed for o in options]
            counts = [r.n_tokens for r in (*hits, *late, *copied, *stranded)]
            floats = [ready_at[(layer, r.expert)] for r in late] + [o.gain for o in options]
            found = native.best(now, self.copy_free, self.times.tokens, sizes, counts, floats)
            if found is not None:
                cost, on, b = found
                if len(late) > tuning.LATE_SUBSETS:  # prefixes: how many lead
                    return cost, late[:on], b
                return cost, [r for j, r in enumerate(late) if on >> j & 1], b
        return self._best_split_reference(plan, late, options, stranded, now)

    def _best_split_reference(self, plan: Plan, late, options, stranded, now):
        """_best_split in Python: the reference of split.c, and where C is not built."""
        tm = self.times
        opt_cpu = [tm.cpu(o.routed.n_tokens) for o in options]
        opt_gpu = [tm.gpu(o.routed.n_tokens) for o in options]
        base_cpu = _added(opt_cpu) + _added(tm.cpu(r.n_tokens) for r in stranded)
        # The token rows of the CPU experts (their activation transfer), left after b options.
        opt_rows = _suffix_sum([o.routed.n_tokens for o in options])
        stranded_rows = sum(r.n_tokens for r in stranded)
        copy_start, t_copy = max(now, self.copy_free), tm.copy
        # How long the copy stream is busy from now with b copies queued, b = 0..len(options).
        copying = [copy_start + b * t_copy - now for b in range(len(options) + 1)]
        gains = [o.gain for o in options]
        beside, act = tm.cpu_beside_copies, tm.act
        best, best_cost = ([], 0), math.inf
        for gpu_a, cpu_a, rows_a, chosen in self._late_choices(plan, late, now):
            gpu, cpu, gain = gpu_a, base_cpu + cpu_a, 0.0
            rows_a += stranded_rows
            for b, busy in enumerate(copying):
                if b:
                    gpu = max(gpu, now + busy) + opt_gpu[b - 1]
                    cpu -= opt_cpu[b - 1]
                    gain += gains[b - 1]
                rows = rows_a + opt_rows[b]
                cpu_end = now + (beside(cpu, busy) + act(rows)) if rows else now
                cost = max(cpu_end, gpu) - gain
                if cost < best_cost - 1e-12:
                    best, best_cost = (chosen, b), cost
        return best_cost, list(best[0]), best[1]

    def _late_choices(self, plan: Plan, late, now) -> list[tuple]:
        """The undominated ways to split the late experts (in flight, soonest first) between GPU
        and CPU: (GPU end, CPU seconds, token rows on the CPU, the GPU's share). The GPU takes
        them as they land (the best order for one machine with release times), so an exact
        Pareto front over the three figures; beyond `tuning.LATE_SUBSETS` experts, prefixes."""
        tm = self.times
        start = now + _added(tm.gpu(r.n_tokens) for r in plan.gpu_hits)
        front = [(start, 0.0, 0, ())]
        exact = len(late) <= tuning.LATE_SUBSETS
        for r in late:
            ready = self.cache.ready_at[(plan.layer, r.expert)]
            g, t, n = tm.gpu(r.n_tokens), tm.cpu(r.n_tokens), r.n_tokens
            grown = [(max(gpu, ready) + g, cpu, rows, on + (r,)) for gpu, cpu, rows, on in front]
            if exact:
                grown += [(gpu, cpu + t, rows + n, on) for gpu, cpu, rows, on in front]
                front = _undominated(grown)
            else:  # prefixes: the first a on the GPU, the rest on the CPU
                front.append(grown[-1])
        if not exact:
            cpu_left = [_added(tm.cpu(r.n_tokens) for r in late[a:]) for a in range(len(late) + 1)]
            rows = _suffix_sum([r.n_tokens for r in late])
            front = [(g, cpu_left[a], rows[a], on) for a, (g, _, _, on) in enumerate(front)]
        return front

    def _issue(self, layer: int, expert: int, how, now: float, out: list[Copy]) -> Copy:
        """Queue one copy on the copy stream and record it in the cache."""
        start = max(now, self.copy_free)
        ready = start + self.times.copy  # cost.t_copy()
        self.copy_free = ready
        key, victim, slot = (layer, expert), None, None
        if how != "stage" and self.policy.keeps_copies:
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
        """Predicted finish times of the chosen split (the same arithmetic as _best_split)."""
        tm, now = self.times, plan.now
        counts = [r.n_tokens for r in plan.cpu]
        work = sum(tm.cpu_all(counts))
        plan.cpu_finish = now + tm.cpu_beside_copies(work, self.copy_free - now)
        if counts:
            plan.cpu_finish += tm.act(sum(counts))
        t = now + sum(tm.gpu_all([r.n_tokens for r in plan.gpu_hits]))
        ready = plan.ready
        copied = sorted(plan.gpu_copied, key=lambda r: ready[r.expert])  # ties as they came
        for r, g in zip(copied, tm.gpu_all([r.n_tokens for r in copied])):
            t = max(t, ready[r.expert]) + g
        plan.gpu_finish = t

    def _background(self, layer: int, now: float, plan: Plan) -> None:
        """Copies the policy wants for later (admissions, prefetches)."""
        # An idle stream always takes one; a busy one only while its backlog ends `slack` copies
        # before this layer does (so the next layer's demand copies do not queue behind it), or,
        # for a policy that `copies_in_gap`, before the next layer's plan (this layer's end plus
        # the measured gap between layers: the stream works on through the dense part). Keys the
        # look-ahead hint ranks top-k may have a slack of their own (`hinted_slack`).
        deadline = plan.makespan + (self.gap if self.policy.copies_in_gap else 0.0)
        t_copy = self.times.copy  # cost.t_copy()
        end = deadline - self.policy.background_slack * t_copy
        hinted = self.policy.hinted_slack
        end_hinted = end if hinted is None else deadline - hinted * t_copy
        last = max(end, end_hinted)
        if self.copy_free > now and self.copy_free >= last:
            return
        keys, narrowed = self._background_keys(layer, now, plan, end)
        protect = None  # made at the first key (most layers have none past the deadline)
        while not (self.copy_free > now and self.copy_free >= last):
            if not narrowed and self.copy_free > now and self.copy_free >= end:
                keys, narrowed = self._hinted_only(keys), True  # the stream's backlog only grows
            key = next(keys, None)
            if key is None:
                break
            if protect is None:
                protect = self.protected(now, plan)
            if key in self.cache or key in protect:
                continue
            ok, victim = self.policy.make_room(key, protect, now, self.cache.free_count())
            if not ok or not self.policy.worth(key, victim, now):
                continue
            self._issue(key[0], key[1], ("evict", victim), now, plan.prefetches)
            protect.add(key)
            self._prefetched.add(key)
            self.stats.prefetches_issued += 1

    def _background_keys(self, layer: int, now: float, plan: Plan, end: float):
        """The policy's background keys, and whether they are narrowed to the hinted ones already:
        past the usual deadline `end` from the start, the loop keeps just the keys the look-ahead
        hint ranks top-k, so only those are asked for (`_hinted_keys`)."""
        if self.copy_free > now and self.copy_free >= end:
            return self._hinted_keys(layer, now, plan), True
        return iter(self.policy.background(layer, now, plan)), False

    def _hinted_keys(self, layer: int, now: float, plan: Plan):
        """The policy's background keys that the look-ahead hint ranks among their layer's top-k,
        in their order: the policy's own way to them, else those of the layers the hint speaks
        of, narrowed."""
        keys = self.policy.background_hinted(layer, now, plan)
        if keys is not None:
            return keys
        rows = np.flatnonzero((self.predictor.router == ROUTER_TOP).any(axis=1))  # ordinals
        return self._hinted_only(iter(self.policy.background_in(rows, layer, now, plan)))

    def _hinted_only(self, keys):
        """Of the keys still to come, those the look-ahead hint ranks among their layer's top-k,
        in the same order: a policy's `Ranked` order narrows itself without reading the others."""
        router = self.predictor.router  # [L, E] by ordinal: flat key = ordinal * E + expert
        if isinstance(keys, Ranked):
            return keys.narrow(lambda flat: router.ravel()[flat] == ROUTER_TOP)
        return (k for k in keys if router[self.ordinal[k[0]], k[1]] == ROUTER_TOP)

    def _count(self, plan: Plan, routed: list[Routed]) -> None:
        s, tm = self.stats, self.times
        s.layers += 1
        s.routed += len(routed)
        s.hits += len(plan.gpu_hits)
        s.late_hits += self._late
        s.misses += len(routed) - len(plan.gpu_hits)
        s.cpu_runs += len(plan.cpu)
        s.gpu_runs += len(plan.gpu_hits) + len(plan.gpu_copied)
        s.demand_copies += len(plan.copies)
        s.cpu_busy_s += plan.cpu_finish - plan.now if plan.cpu else 0.0
        s.gpu_busy_s += sum(tm.gpu_all([r.n_tokens for r in plan.gpu_hits + plan.gpu_copied]))
        s.predicted_s += plan.makespan - plan.now


_NO_ROOM = object()


def _undominated(points: list[tuple]) -> list[tuple]:
    """The points no other beats (or ties) on all of their first three figures."""
    points.sort(key=lambda p: p[:3])
    kept = []
    for p in points:
        if not any(q[1] <= p[1] and q[2] <= p[2] for q in kept):
            kept.append(p)
    return kept


def _added(values) -> float:
    """The values added left to right in doubles, as split.c adds them (sum() compensates its
    rounding from Python 3.12 on)."""
    total = 0.0
    for v in values:
        total += v
    return total


def _suffix_sum(values: list[int]) -> list[int]:
    """out[i] = sum(values[i:]), with out[len(values)] = 0."""
    out = [0] * (len(values) + 1)
    for i in range(len(values) - 1, -1, -1):
        out[i] = values[i] + out[i + 1]
    return out


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
    profile_hints=None,
) -> Planner:
    """A planner with its cache placed and its policy and predictor warm: the one way to build one,
    for the engine's runtime and the simulator alike.

    `policy` is a Policy object (policies.make_policy). `stats` (activation statistics from a file)
    warm the predictor and the policy and order the placement. `profile`: routed steps (per step, a
    list per MoE layer of Routed) to learn from first, in order; their counts stand in for `stats`
    when none are given, and the predictor is scored only on what comes after them.
    `profile_hints`: per profile step and layer, the next layer's router scores (or None).
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
    for s, step in enumerate(profile):
        planner.begin_step()
        for o, (layer, routed) in enumerate(zip(layers, step)):
            planner.observe_only(layer, routed, profile_hints[s][o] if profile_hints else None)
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
