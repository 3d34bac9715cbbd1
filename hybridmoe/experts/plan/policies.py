"""Cache and placement policies under one interface, so each peer is a baseline we can run.

The planner (planner.py) does the scheduling arithmetic; a policy answers its questions:
may a miss be copied (`copy_rule`), kept (`keeps_copies`) or staged in a buffer that is not kept
(`may_stage`), which resident to evict for a key (`make_room`), what a copy
leaves behind is worth (`admit_gain`, seconds), which keys to copy in the background
(`background`), and whether one is worth its victim (`worth`).

| name      | behaviour                                      | whose                               |
|-----------|------------------------------------------------|-------------------------------------|
| cpu       | every routed expert on the CPU                 | KTransformers 0 GPU experts,        |
|           |                                                | llama.cpp --cpu-moe                 |
| static    | placed set pinned, never changes; misses on    | KTransformers --kt-num-gpu-experts, |
|           | the CPU (staged to the GPU from 32 tokens)     | llama.cpp --n-cpu-moe               |
| fiddler   | static popular set; a miss is copied (not      | Fiddler                             |
|           | kept) iff copy+GPU beats the CPU               |                                     |
| hybrimoe  | makespan split, per-layer cache by EMA of      | HybriMoE                            |
|           | router score (a=0.5), next-layer prefetch      |                                     |
| lru, lfu  | per-layer demand caching: every miss is        | mixtral-offloading                  |
|           | admitted, least recent/frequent out            |                                     |
| value     | admission and eviction by predicted time to    | ours                                |
|           | next use, weighed by the cost model            |                                     |
| belady    | demand caching, evicts the key used farthest   | offline bound                       |
|           | in the future (simulation)                     |                                     |
"""

from __future__ import annotations

import numpy as np

import hybridmoe.native.predictor_kernels as predictor_kernels
from hybridmoe import tuning
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.ranked import HEAD, Ranked
from hybridmoe.experts.plan.shape import Key


class Policy:
    name = "base"
    uses_gpu = True
    copy_rule = "makespan"  # "makespan" (the planner's split) | "threshold" (per expert)
    keeps_copies = True  # a demand copy may be admitted to the cache
    # Tokens in a layer from which a copy may go to a staging buffer that is not kept (where the
    # cache has no room, or admitting would evict something likelier to be used); None = never.
    stage_from: int | None = 0
    partition = False  # per-layer slot quotas, as caches built per layer module are
    default_placement = "frequency"
    pin_placement = False  # placed experts pinned (static sets) or only a warm start
    # Background copies are queued only if they finish this many copy-times before the layer ends.
    background_slack = tuning.BACKGROUND_SLACK
    # Whether that deadline is the next layer's start (this layer's end plus the gap between
    # layers: dense part, planning) rather than this layer's end.
    copies_in_gap = False
    # The slack for keys the look-ahead hint ranks among their layer's top-k (the next layers'
    # routers on this layer's input, where the engine gives them); None: background_slack.
    hinted_slack: float | None = None
    # Whether the policy's predictor learns cross-layer co-occurrence (ours); a peer keeps the
    # signals its paper describes (HybriMoE: the next router, or recency/frequency without it).
    cross_layer = False
    uses_predictor = False  # reads the predictor (else the planner leaves it untouched)
    needs_future = False  # knows the trace ahead: runs only in the simulator

    def bind(self, planner) -> None:
        self.planner, self.cache, self.cost, self.predictor = (
            planner,
            planner.cache,
            planner.cost,
            planner.predictor,
        )
        self.L, self.E = len(planner.layers), planner.predictor.num_experts
        self._ranked, self._ranked_epoch = [], None

    # ---- hooks the planner calls -------------------------------------------------------------
    def warm_start(self, stats) -> None:
        """Activation statistics (an ExpertStats) from a profile run or file."""

    def on_use(self, layer: int, routed, now: float) -> None:
        pass

    def on_insert(self, key: Key, victim: Key | None, now: float) -> None:
        pass

    def keep_score(self, key: Key, now: float) -> float:
        """Higher = keep longer; the victim is the evictable key with the lowest score."""
        return 0.0

    def admit_gain(self, key: Key, victim: Key | None, now: float) -> float:
        return 0.0

    def admit_gain_at(self, now: float):
        """`admit_gain` at `now`, as a function of (key, victim): what a plan asks of each of its
        copy options (a policy may answer them from one snapshot)."""
        return lambda key, victim: self.admit_gain(key, victim, now)

    def copy_priority(self, key: Key) -> float:
        """Among misses that save the same CPU time, which to copy first (higher first)."""
        return 0.0

    def copy_priorities(self, layer: int, experts: list[int]) -> list[float]:
        """copy_priority of several experts of one layer."""
        return [self.copy_priority((layer, e)) for e in experts]

    def background(self, layer: int, now: float, plan):
        return ()

    def background_in(self, rows: np.ndarray, layer: int, now: float, plan):
        """`background`'s keys of the layer ordinals `rows` only, in the same order (the planner
        wants no others; a policy may return them all, and the planner skips the rest)."""
        return self.background(layer, now, plan)

    def background_hinted(self, layer: int, now: float, plan):
        """`background`'s keys that the look-ahead hint ranks among their layer's top-k, in the
        same order, where the policy has a quicker way to them than the planner's (which narrows
        `background_in` of the hinted layers); None: it has not."""
        return None

    def prepare_next(self) -> None:
        """Work for the next plan that can be done while this layer's experts run."""

    def worth(self, key: Key, victim: Key | None, now: float) -> bool:
        return True

    def may_stage(self, tokens: float) -> bool:
        """Whether this layer's misses (`tokens` tokens in the step) may be copied unkept."""
        return self.stage_from is not None and tokens >= self.stage_from

    def make_room(
        self, key: Key, protect: set[Key], now: float, free: int, taken: int = 0
    ) -> tuple[bool, Key | None]:
        """(True, None): a free slot; (True, victim): evict it; (False, None): no room. `free`:
        slots still free; `taken`: free slots already promised to `key`'s layer by this plan."""
        if self.partition:
            return self._room_in_layer(key, protect, now, free, taken)
        if free > 0:
            return True, None
        victim = self._victim(None, protect, now)
        return victim is not None, victim

    def rooms(self, layer: int, protect: set[Key], now: float, free: int):
        """The room `layer`'s demand copies may take, best first: None for each free slot (within
        the layer's quota for a per-layer policy), then victims. Read as far as needed; each
        victim read is added to `protect`."""
        if self.partition:
            i = self.planner.ordinal[layer]
            yield from [None] * max(
                0, min(free, self._quota(layer) - int(self.cache.mask[i].sum()))
            )
            mine = np.flatnonzero(self.cache.mask[i] & ~self.cache.pinned_mask[i])  # [m] experts
            ranked = mine[np.argsort(self.row_scores(i, now)[mine], kind="stable")].tolist()
            victims = ((layer, e) for e in ranked)
        else:
            yield from [None] * free
            victims = (
                k for k in self._ranking(now) if k in self.cache and k not in self.cache.pinned
            )
        for victim in victims:
            if victim not in protect:
                protect.add(victim)
                yield victim

    # ---- shared helpers ----------------------------------------------------------------------
    def row_scores(self, i: int, now: float) -> np.ndarray:
        """keep_score of every expert of the layer of ordinal i, [E]."""
        layer = self.planner.layers[i]
        return np.array([self.keep_score((layer, e), now) for e in range(self.E)])

    def _victim(self, keys, protect, now):
        """The evictable key with the lowest keep_score. Scores only change when the planner's
        epoch does (a new layer, or new observations), so the ranking is computed once per epoch."""
        for k in self._ranking(now):
            if k not in protect and k in self.cache and k not in self.cache.pinned:
                return k
        return None

    def _ranking(self, now):
        epoch = self.planner.epoch
        if self._ranked_epoch != epoch:
            self._ranked = sorted(self.cache.dynamic(), key=lambda k: self.keep_score(k, now))
            self._ranked_epoch = epoch
        return self._ranked

    def _quota(self, layer: int) -> int:
        base, extra = divmod(self.cache.slots, self.L)
        return base + (self.planner.ordinal[layer] < extra)

    def _room_in_layer(self, key, protect, now, free, taken=0):
        """A free slot within the layer's quota, else its lowest-scored unprotected resident."""
        cache, i = self.cache, self.planner.ordinal[key[0]]
        if free > 0 and int(cache.mask[i].sum()) + taken < self._quota(key[0]):
            return True, None
        mine = np.flatnonzero(cache.mask[i] & ~cache.pinned_mask[i])  # [m] experts
        if len(mine):
            scores = self.row_scores(i, now)[mine]
            for j in np.argsort(scores, kind="stable"):
                victim = (key[0], int(mine[j]))
                if victim not in protect:
                    return True, victim
        return False, None

    def _cpu_misses(self, layer, plan):
        """This layer's experts that just ran on the CPU: demand caching admits them."""
        return [(layer, r.expert) for r in plan.cpu]


class CPUPolicy(Policy):
    name = "cpu"
    uses_gpu = False


class StaticPolicy(Policy):
    """A fixed set on the GPU. Like llama.cpp with its MoE weights in host RAM, a layer with at
    least `LLAMA_CPP_OFFLOAD_BATCH` tokens may copy its missed experts over for the layer (staged,
    never kept); below that, as in decode, misses run on the CPU."""

    name = "static"
    keeps_copies = False
    stage_from = tuning.LLAMA_CPP_OFFLOAD_BATCH
    pin_placement = True


class FiddlerPolicy(Policy):
    """Fiddler: popular experts resident; a miss runs where it is faster, the copy is not kept."""

    name = "fiddler"
    copy_rule = "threshold"
    keeps_copies = False
    pin_placement = True


class HybriMoEPolicy(Policy):
    """HybriMoE: makespan split; per-layer cache scored by EMA of router probabilities; prefetch
    of the next layer's predicted experts while the transfer stream is idle. Without router scores
    it gets the same predictor our policy uses (recency and frequency), so it is not starved."""

    name = "hybrimoe"
    partition = True
    uses_predictor = True
    default_placement = "uniform"
    alpha = 0.5  # HybriMoE's score-cache EMA factor

    def bind(self, planner) -> None:
        super().bind(planner)
        self.score = np.zeros((self.L, self.E))  # [L, E] EMA of router weights

    def on_use(self, layer, routed, now):
        i, a = self.planner.ordinal[layer], self.alpha
        row = self.score[i]
        row *= 1 - a
        row[[r.expert for r in routed]] += a * np.array([r.weight for r in routed])

    def on_insert(self, key, victim, now):
        # A prefetched expert enters with its predicted score,
        # so the next prefetch does not evict it.
        i = self.planner.ordinal[key[0]]
        p = self.predictor.p_next(key) / self.predictor.top_k
        self.score[i, key[1]] = max(self.score[i, key[1]], self.alpha * p)

    def keep_score(self, key, now):
        return float(self.score[self.planner.ordinal[key[0]], key[1]])

    def row_scores(self, i, now):
        return self.score[i]

    def copy_priority(self, key):
        return self.keep_score(key, 0.0)

    def copy_priorities(self, layer, experts):
        return self.score[self.planner.ordinal[layer], experts].tolist()

    def background(self, layer, now, plan):
        o = self.planner.ordinal[layer]
        if o + 1 >= self.L:
            nxt = self.planner.layers[0]  # the first layer of the next step
        else:
            nxt = self.planner.layers[o + 1]
        return [(nxt, e) for e in self.predictor.predict(nxt)]


class LRUPolicy(Policy):
    """mixtral-offloading: an LRU cache per layer; every miss is brought in (here after running on
    the CPU when that is faster, the copy in the background)."""

    name = "lru"
    partition = True
    default_placement = "uniform"

    def bind(self, planner) -> None:
        super().bind(planner)
        self.last = np.full((self.L, self.E), -1.0)  # [L, E] position of the last use

    def on_use(self, layer, routed, now):
        self.last[self.planner.ordinal[layer], [r.expert for r in routed]] = self.planner.position

    def keep_score(self, key, now):
        return float(self.row_scores(self.planner.ordinal[key[0]], now)[key[1]])

    def row_scores(self, i, now):
        return self.last[i]

    def background(self, layer, now, plan):
        return self._cpu_misses(layer, plan)


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def bind(self, planner) -> None:
        super().bind(planner)
        self.uses = np.zeros((self.L, self.E))  # [L, E] uses (the warm start's counts first)

    def on_use(self, layer, routed, now):
        super().on_use(layer, routed, now)
        self.uses[self.planner.ordinal[layer], [r.expert for r in routed]] += 1

    def warm_start(self, stats):
        for layer, row in zip(stats.layers, stats.counts):
            self.uses[self.planner.ordinal[layer]] = row

    def row_scores(self, i, now):
        return self.uses[i] + 1e-9 * self.last[i]  # ties: least recent out


class ValuePolicy(Policy):
    """Ours. A resident's worth is its expected distance to next use, Belady's criterion with the
    predictor's probability p of use at each visit: D = d + L(1-p)/p layers (d = layers until its
    layer runs again; a miss at a visit costs one more lap of L). Evict the largest D; copy in a
    key only if its D beats the victim's and the copy can arrive before its layer runs. The gain
    of a copy in the planner's objective is the expected CPU time it saves at the next visit."""

    name = "value"
    cross_layer = True
    uses_predictor = True
    # A copy costs stream time whether it is a demand copy or a background one; a background copy
    # of a likely expert is worth more than the last demand copies of a layer, which save little
    # beyond the DRAM they take from the CPU. So value keeps the stream busy through the gap
    # between layers as well.
    copies_in_gap = True
    background_slack = tuning.VALUE_BACKGROUND_SLACK
    # A key the next layer's router ranks among its top-k (used ~0.85 of the time on the demo
    # traces, against 0.6-0.8 for the other background copies) is about the copy that layer would
    # demand: queued as it is wanted, it may run on to the next plan.
    hinted_slack = tuning.VALUE_HINTED_SLACK

    def distance(self, key: Key, now: float, arrive: float | None = None) -> float:
        # Used at the next visit with p (which may carry the cross-layer signal, good for that one
        # visit only), at each later one with q (recency, frequency): D = d + (1 - p) * L / q.
        # The variants measured against it: docs/notes/2026-11-24-measurements-in-code.md, "The
        # value policy's distance".
        p = max(self.predictor.p_next(key), 1e-3)
        q = max(self.predictor.p_base(key), 1e-3)
        d = self.planner.distance(key[0])
        if (
            arrive is not None
            and self.planner.layer_period > 0
            and arrive > now + d * self.planner.layer_period
        ):
            d += self.L  # the copy would miss this visit
        return d + self.L * (1.0 - p) / q

    def keep_score(self, key, now):
        return -self.distance(key, now)

    def copy_priority(self, key):
        return self.predictor.p_next(key)

    def copy_priorities(self, layer, experts):
        return self._view().p_used[experts].tolist()

    def admit_gain(self, key, victim, now):
        return self._view().admit_gain(key, victim)

    def admit_gain_at(self, now):
        return self._view().admit_gain  # the plan changes nothing the view depends on

    def worth(self, key, victim, now):
        if victim is None:
            return self.predictor.p_next(key) > 0.0
        arrive = max(now, self.planner.copy_free) + self.cost.t_copy()
        return self.distance(key, now, arrive) < (1.0 - tuning.VALUE_MARGIN) * self.distance(
            victim, now
        )

    # ---- the same, for many keys at once ---------------------------------------------------
    def bind(self, planner) -> None:
        super().bind(planner)
        self._layer_ids = tuple(planner.layers)
        k = min(tuning.VALUE_CANDIDATES_PER_LAYER, self.E)
        self._cand = np.zeros((self.L, k), dtype=np.intp)  # [L, k] each layer's best non-residents
        self._cand_seen = np.full((2, self.L), -1, dtype=np.int64)  # versions they were made at
        self._ranked_at = None
        self._c = None  # predictor.c's value kernels over these arrays (`_kernels`)

    def prepare_next(self) -> None:
        """Make the next plan's view now, while this layer's experts run (the head of its
        victims ranked too)."""
        self._preview = self._make_view(self.planner.position + 1)

    def _view(self) -> _View:
        """The view of the layer being planned: the one prepare_next made, unless something it
        depends on has changed since (then made afresh)."""
        view = getattr(self, "_preview", None)
        if view is not None and view.checked == self.planner.epoch:
            return view
        if view is None or view.stamp != self._stamp(self.planner.position):
            view = self._preview = self._make_view(self.planner.position)
        view.checked = self.planner.epoch  # the epoch changes with every plan and prepare
        return view

    def _stamp(self, position: int) -> tuple:
        return position, self.predictor.changes, self.cache.changes

    def _make_view(self, position: int) -> _View:
        """What a plan at `position` asks: its layer's probabilities after the visit, and the
        evictable residents by distance, largest first. The plan's layer's residents are scored as
        not used at this visit: the used ones are hits, protected from eviction."""
        here = position % self.L
        v = self._kernels()
        if v is not None:  # after_visit, _residents_by and the ranking's head in one call
            P, _ = self.predictor.matrices()
            n = v.lib.hm_value_view(v.v, here, 1, HEAD)
            p_used, p_not = v.after[0].copy(), v.after[1].copy()
            victims = self._in_order(v.flat[:n], v.score[:n], head=v.idx[: min(n, HEAD)])
        else:
            p_used, p_not = self.predictor.after_visit(self.planner.layers[here])
            P, Q = self.predictor.matrices()
            victims = self._in_order(*self._residents_by(position, here, p_not))
        return _View(
            self._stamp(position),
            here,
            p_used,
            p_not,
            P,
            self.planner.ordinal,
            self._hit_saving(),
            _Lazy(victims),
        )

    def _hit_saving(self) -> float:
        """cost.hit_saving(1), from the planner's memoised times."""
        tm = self.planner.times
        return max(0.0, tm.cpu(1) - tm.gpu(1)) if self.cost.has_gpu else 0.0

    def _residents_by(self, position: int, here: int, p_not) -> tuple[np.ndarray, np.ndarray]:
        """The dynamic residents as flat keys (ordinal * E + expert) [n], in row-major order, and
        minus their distance [n], the planned layer's (ordinal `here`) scored with p_not."""
        mask, pinned = self.cache.mask, self.cache.pinned_mask
        P, Q = self.predictor.matrices()
        flat = np.flatnonzero(mask & ~pinned)  # [n]
        rows = flat // self.E
        p, q = P.ravel()[flat], Q.ravel()[flat]  # [n] each
        mine = rows == here
        p[mine] = q[mine] = p_not[flat[mine] - here * self.E]
        d = self.planner.distances(position)[rows]
        return flat, -(d + self.L * (1.0 - np.maximum(p, 1e-3)) / np.maximum(q, 1e-3))

    def _ranking(self, now):
        """Dynamic residents, largest distance first (the lowest keep_score): the plan's view,
        or, once the plan has changed the predictor or the cache, made afresh."""
        view = getattr(self, "_preview", None)
        if view is not None and view.stamp == self._stamp(self.planner.position):
            return view.victims()
        at = (self.planner.position, self.predictor.changes)
        if self._ranked_at != at:
            self._ranked = _Lazy(self._every_key(now))
            self._ranked_at = at
        return self._ranked

    def _distances(self, rows, cols, now, arrive=None) -> np.ndarray:
        """`distance` of the keys (layer ordinal rows[j], expert cols[j]) [n]."""
        P, Q = self.predictor.matrices()
        d = self.planner.distances()[rows]
        t = self.planner.layer_period
        if arrive is not None and t > 0:
            d = d + self.L * (arrive > now + d * t)  # the copy would miss this visit
        p = np.maximum(P[rows, cols], 1e-3)
        q = np.maximum(Q[rows, cols], 1e-3)
        return d + self.L * (1.0 - p) / q

    def _every_key(self, now):
        """The dynamic residents, largest distance first, ties by key."""
        v, mask, pinned = self._kernels(), self.cache.mask, self.cache.pinned_mask
        if v is not None:
            self.predictor.matrices()
            n = v.lib.hm_value_view(v.v, self.planner.position % self.L, 0, HEAD)
            return self._in_order(v.flat[:n], v.score[:n], head=v.idx[: min(n, HEAD)])
        rows, cols = np.nonzero(mask & ~pinned)
        return self._in_order(rows * self.E + cols, -self._distances(rows, cols, now))

    def _in_order(self, flat, scores, head=None) -> Ranked:
        """Keys (flat: ordinal * E + expert) by `scores`, lowest first, ties by key (`head`: the
        positions of the first ones, where a kernel ranked them)."""
        return Ranked(flat, scores, self._layer_ids, self.E, self.predictor.native, head)

    def background(self, layer, now, plan):
        """Each layer's most likely experts not resident, shortest distance first, ties by key
        (counting a copy that cannot arrive in time as a miss of that visit)."""
        v = self._kernels()
        if v is not None:
            return self._background_c(v, None, False, now)
        return self.background_in(np.arange(self.L), layer, now, plan)

    def background_hinted(self, layer, now, plan):
        """In C, the hinted keys straight away (the hint's rows are those with hinted keys)."""
        v = self._kernels()
        return None if v is None else self._background_c(v, None, True, now)

    def _background_c(self, v, rows, top_only: bool, now: float) -> Ranked:
        """background_in (every layer where `rows` is None), or with `top_only` its keys the
        router ranks top-k, in one call (predictor.c's hm_value_background)."""
        self.predictor.matrices()
        arrive = max(now, self.planner.copy_free) + self.planner.times.copy  # cost.t_copy()
        here, t = self.planner.position % self.L, self.planner.layer_period
        if rows is not None:
            v.rows[: len(rows)] = rows
        at, count = (None, 0) if rows is None else (v.rows_at, len(rows))
        n = v.lib.hm_value_background(v.v, at, count, top_only, here, now, arrive, t)
        return Ranked.ordered(v.out[:n], self._layer_ids, self.E) if n else iter(())

    def background_in(self, rows, layer, now, plan):
        """The same, of the layer ordinals `rows` [r] (ascending) only: those keys come in the
        same order, the order being total."""
        v = self._kernels()
        if v is not None:
            return self._background_c(v, rows, False, now)
        versions = np.stack([self.predictor.row_version[rows], self.cache.row_version[rows]])
        stale = (versions != self._cand_seen[:, rows]).any(axis=0)  # [r]
        changed = rows[stale]
        self._cand_seen[:, changed] = versions[:, stale]
        arrive = max(now, self.planner.copy_free) + self.cost.t_copy()
        k, mask = self._cand.shape[1], self.cache.mask
        P, _ = self.predictor.matrices()
        for i in changed:
            p = np.where(mask[i], -np.inf, P[i])  # [E]
            self._cand[i] = np.argsort(-p, kind="stable")[:k]
        at = np.repeat(rows, k)
        cols = self._cand[rows].ravel()
        keep = ~mask[at, cols]  # a layer with fewer than k non-residents
        at, cols = at[keep], cols[keep]
        distance = self._distances(at, cols, now, arrive)
        return self._in_order(at * self.E + cols, distance)

    def _kernels(self) -> predictor_kernels.BoundValue | None:
        """predictor.c's value kernels over this policy's arrays and its cache's, or None (the
        numpy path) where the predictor has no C kernels."""
        v, native = self._c, self.predictor.native
        if native is None:
            return None
        if v is None or not v.bound_to(self.cache):
            v = self._c = predictor_kernels.BoundValue(
                native, self.cache, self._cand_seen, self._cand
            )
        return v


class _Lazy:
    """A sequence drawn from an iterator as far as it is read, and kept: several readers of one
    ranking in one plan pay for the prefix they read, once."""

    def __init__(self, items):
        self._items, self._seen = items, []

    def __iter__(self):
        i = 0
        while True:
            if i == len(self._seen):
                nxt = next(self._items, _END)
                if nxt is _END:
                    return
                self._seen.append(nxt)
            yield self._seen[i]
            i += 1


_END = object()


class _View:
    """What the value policy's plan of one layer reads, made before the plan: `p_used` and
    `p_not` [E], the layer's probabilities after its visit for an expert used there or not; the
    seconds a hit saves; the dynamic residents by distance, largest first (`victims`)."""

    def __init__(self, stamp, here, p_used, p_not, P, ordinal, saving, victims):
        self.stamp, self.here, self.p_used, self.p_not, self.P = stamp, here, p_used, p_not, P
        self.ordinal, self.saving, self._victims = ordinal, saving, victims
        self.checked = None  # the planner epoch at which the stamp was last checked
        # read one by one: a memoryview gives Python floats, quicker than numpy's scalars
        self._after = (memoryview(p_not), memoryview(p_used))

    def p_after(self, key: Key, used: bool) -> float:
        """p_next of `key` once the planned visit is counted (`used`: whether it is used at that
        visit, for a key of the planned layer)."""
        i = self.ordinal[key[0]]
        if i != self.here:
            return float(self.P[i, key[1]])
        return self._after[used][key[1]]

    def admit_gain(self, key: Key, victim: Key | None) -> float:
        """ValuePolicy.admit_gain: the copied key is routed at this visit; a victim is not (a
        routed resident is a hit, or in flight: protected either way)."""
        # p_after, inline: a plan asks this dozens of times
        i, after = self.ordinal[key[0]], self._after
        gain = after[1][key[1]] if i == self.here else float(self.P[i, key[1]])
        if victim is not None:
            i = self.ordinal[victim[0]]
            gain -= after[0][victim[1]] if i == self.here else float(self.P[i, victim[1]])
        return self.saving * gain

    def victims(self) -> _Lazy:
        return self._victims


class BeladyPolicy(Policy):
    """Demand caching with Belady's eviction (farthest next use); needs the future: simulation."""

    name = "belady"
    needs_future = True

    def __init__(self, future=None):
        if future is None:
            raise UserError(
                "the belady policy needs the future and runs only in `hybridmoe simulate`; choose "
                "another policy"
            )
        self.future = future

    def keep_score(self, key, now):
        return -self.future.next_use(key, self.planner.position)

    def worth(self, key, victim, now):
        pos = self.planner.position
        return victim is None or self.future.next_use(key, pos) < self.future.next_use(victim, pos)

    def background(self, layer, now, plan):
        return self._cpu_misses(layer, plan)


POLICIES = {
    cls.name: cls
    for cls in (
        CPUPolicy,
        StaticPolicy,
        FiddlerPolicy,
        HybriMoEPolicy,
        LRUPolicy,
        LFUPolicy,
        ValuePolicy,
        BeladyPolicy,
    )
}


# Policies a run of the engine can use: all but those that need the future (simulation only).
RUN_POLICIES = tuple(name for name, cls in POLICIES.items() if not cls.needs_future)


def make_policy(name: str, future=None) -> Policy:
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    return cls(future) if cls is BeladyPolicy else cls()
