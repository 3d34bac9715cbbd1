/* The expert predictor's per-visit arithmetic (hybridmoe/experts/plan/predictor.py) in C: the same
 * formulas, element by element, in the same order, so that every probability comes out the same
 * bits as numpy's (built with -ffp-contract=off, no fast-math). The arrays are the predictor's own
 * numpy arrays, named once in a `pred_t` (predictor_kernels.py) and updated in place. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    long L, E, K, H;           /* layers, experts, top_k, cross-layer horizons (0: none) */
    long NA, NF, NB;           /* age buckets, frequency buckets, bands per base cell */
    long n_age, n_freq, n_lift;
    const double *age_edges, *freq_edges, *lift_edges;
    double prior_w, cross_prior, keep, cross_keep; /* keep: the count's discount (1: none) */
    int64_t *last_use, *visits;                    /* [L, E], [L] */
    double *count, *weight;                        /* [L, E], [L] */
    intptr_t *router, *band, *cell, *banded;       /* [L, E] each */
    double *hits, *trials, *band_hits, *band_trials;
    double *P, *Q;                                 /* [L, E] each */
    double *co, *n, *scale;                        /* [H, L, E, E], [H, L, E], [H, L] */
    double *free_hits, *free_trials;               /* [NA * NF]: any router bucket (p_base) */
    int64_t *row_version;                          /* [L] bumped when a layer's P may change */
    /* the visit's arguments and scratch (predictor_kernels.Bound) */
    long *used;                                    /* [L, E] row i: layer i's experts this step */
    long *n_set;                                   /* [L] how many (0: not visited this step) */
    long *rows;                                    /* [L] rows to refresh */
    double *probs;                                 /* [E] the next layer's router probabilities */
    long *order;                                   /* [2E] scratch */
    double *score;                                 /* [2E] scratch */
} pred_t;

/* np.searchsorted(edges, v, "left") of ascending edges: the edges below v (counted without a
 * branch: which bucket a value falls in is unpredictable) */
static long below(const double *edges, long n, double v) {
    long a = 0;
    for (long j = 0; j < n; j++) a += edges[j] < v;
    return a;
}

static double rate_of(const pred_t *p, long i, long e) {
    double w = p->weight[i] > 1.0 ? p->weight[i] : 1.0; /* np.maximum(1.0, w) */
    return p->count[i * p->E + e] / w;
}

static double at_most_one(double x) { return x < 1.0 ? x : 1.0; }

/* Predictor._refresh: calibration cells and probabilities of layers rows[0..nrows) */
void hm_pred_refresh(const pred_t *p, const long *rows, long nrows) {
    long E = p->E;
    for (long r = 0; r < nrows; r++) {
        long i = rows[r];
        for (long e = 0; e < E; e++) {
            long x = i * E + e;
            double rate = rate_of(p, i, e);
            int64_t age = p->visits[i] - p->last_use[x] + 1;
            long a = below(p->age_edges, p->n_age, (double)age);
            long f = below(p->freq_edges, p->n_freq, rate * (double)E / (double)p->K);
            long free = a * p->NF + f, base = p->router[x] * p->NA * p->NF + free;
            double prior = p->prior_w * at_most_one(rate);
            double q = (p->hits[base] + prior) / (p->trials[base] + p->prior_w);
            p->cell[x] = base;
            p->Q[x] = (p->free_hits[free] + prior) / (p->free_trials[free] + p->prior_w);
            if (p->band[x] != 0) {
                long b = base * p->NB + p->band[x];
                p->banded[x] = b;
                q = (p->band_hits[b] + prior) / (p->band_trials[b] + p->prior_w);
            }
            p->P[x] = q;
        }
    }
}

/* Predictor.count_use, once its row is fresh: the calibration tables, recency and frequency */
void hm_pred_count_use(const pred_t *p, long i, const long *used, long n_used, int with_band) {
    long E = p->E;
    intptr_t *cell = p->cell + i * E, *banded = p->banded + i * E;
    long n_free = p->NA * p->NF; /* the (recency, frequency) cells, whatever the router said */
    for (long e = 0; e < E; e++) p->trials[cell[e]] += 1.0;
    for (long u = 0; u < n_used; u++) p->hits[cell[used[u]]] += 1.0;
    for (long e = 0; e < E; e++) p->free_trials[cell[e] % n_free] += 1.0;
    for (long u = 0; u < n_used; u++) p->free_hits[cell[used[u]] % n_free] += 1.0;
    if (with_band) {
        for (long e = 0; e < E; e++) p->band_trials[banded[e]] += 1.0;
        for (long u = 0; u < n_used; u++) p->band_hits[banded[used[u]]] += 1.0;
    }
    p->visits[i] += 1;
    double *count = p->count + i * E;
    if (p->keep != 1.0) {
        for (long e = 0; e < E; e++) count[e] *= p->keep;
        p->weight[i] *= p->keep;
    }
    p->weight[i] += 1.0;
    for (long u = 0; u < n_used; u++) {
        p->last_use[i * E + used[u]] = p->visits[i];
        count[used[u]] += 1.0;
    }
    memset(p->router + i * E, 0, E * sizeof(intptr_t));
    memset(p->band + i * E, 0, E * sizeof(intptr_t));
}

/* Insert id e with value v into the m best so far (best[0..*n), ids[0..*n)) by descending value,
 * an equal one after those before it: the head of np.argsort(-v, kind="stable") as the ids come
 * in ascending order */
static void keep_best(double *best, long *ids, long *n, long m, double v, long e) {
    if (*n == m && !(v > best[m - 1])) return; /* an equal one came first */
    long at = *n < m ? (*n)++ : m - 1;
    while (at > 0 && v > best[at - 1]) {
        best[at] = best[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    best[at] = v;
    ids[at] = e;
}

/* Predictor.set_router_scores: rank < k: 3, < 2k: 2, else 1, ranks by descending probs, ties by
 * id (order: 2E longs of scratch; only the 2k best are ranked) */
void hm_pred_router(const pred_t *p, long i, const double *probs, long *order) {
    long E = p->E, K = p->K, m = 2 * K < E ? 2 * K : E, n = 0;
    double *best = (double *)(order + E); /* m doubles, in the second half of the scratch */
    for (long e = 0; e < E; e++) keep_best(best, order, &n, m, probs[e], e);
    intptr_t *row = p->router + i * E;
    for (long e = 0; e < E; e++) row[e] = 1;
    for (long r = 0; r < n; r++) row[order[r]] = r < K ? 3 : 2;
}

/* CrossLayer.learn: layer i used `used`; for horizon index h, what layer i-h-1 used at this step
 * is row i-h-1 of p->used, p->n_set[i-h-1] of them (none: not visited yet) */
void hm_pred_learn(const pred_t *p, long i, const long *used, long n_used) {
    long L = p->L, E = p->E;
    for (long h = 0; h < p->H; h++) {
        long from = i - (h + 1);
        if (from < 0 || p->n_set[from] == 0) continue;
        const long *src = p->used + from * E;
        double *scale = p->scale + h * L + from;
        double *co = p->co + (h * L + from) * E * E, *n = p->n + (h * L + from) * E;
        *scale *= p->cross_keep;
        if (*scale < 1e-150) { /* fold the scale in before it underflows */
            for (long x = 0; x < E * E; x++) co[x] *= *scale;
            for (long x = 0; x < E; x++) n[x] *= *scale;
            *scale = 1.0;
        }
        double one = 1.0 / *scale;
        for (long a = 0; a < p->n_set[from]; a++) /* scattered rows: ask for them at once */
            for (long b = 0; b < E; b += 8) __builtin_prefetch(co + src[a] * E + b, 1);
        for (long a = 0; a < p->n_set[from]; a++) {
            double *row = co + src[a] * E;
            for (long u = 0; u < n_used; u++) row[used[u]] += one;
            n[src[a]] += one;
        }
    }
}

/* Predictor.look_ahead's scores: the band of every expert of layer i+h+1 given what layer i used,
 * for each horizon index h that stays within the layers (score: 2E doubles of scratch) */
void hm_pred_bands(const pred_t *p, long i, const long *used, long n_used, double *score) {
    long L = p->L, E = p->E;
    for (long h = 0; h < p->H; h++) {
        long j = i + h + 1;
        if (j >= L) continue;
        double scale = p->scale[h * L + i];
        const double *co = p->co + (h * L + i) * E * E, *n = p->n + (h * L + i) * E;
        double *prior = score + E; /* cross_prior * f(b), the same for every a */
        /* the rows are scattered over the counts (megabytes): ask for them all at once */
        for (long a = 0; a < n_used; a++)
            for (long b = 0; b < E; b += 8) __builtin_prefetch(co + used[a] * E + b);
        for (long b = 0; b < E; b++) {
            score[b] = -1.0 / 0.0;
            prior[b] = p->cross_prior * at_most_one(rate_of(p, j, b));
        }
        for (long a = 0; a < n_used; a++) {
            const double *row = co + used[a] * E;
            double den = n[used[a]] * scale + p->cross_prior;
            for (long b = 0; b < E; b++) {
                double c = (row[b] * scale + prior[b]) / den;
                score[b] = c > score[b] ? c : score[b];
            }
        }
        for (long b = 0; b < E; b++) {
            long level = below(p->lift_edges, p->n_lift, score[b] * (double)E / (double)p->K);
            p->band[j * E + b] = 1 + h * (p->n_lift + 1) + level;
        }
    }
}

/* Predictor.after_visit: layer i's p_next once its coming visit is counted, for an expert used
 * there (out[0..E)) and one not (out[E..2E)) */
void hm_pred_after_visit(const pred_t *p, long i, double *out) {
    long E = p->E;
    double w = p->weight[i] * p->keep + 1.0;
    if (w < 1.0) w = 1.0;
    for (long e = 0; e < E; e++) {
        double count = p->count[i * E + e] * p->keep;
        for (int not_used = 0; not_used < 2; not_used++) {
            double rate = (not_used ? count : count + 1.0) / w;
            int64_t age = not_used ? p->visits[i] + 2 - p->last_use[i * E + e] : 1;
            long a = below(p->age_edges, p->n_age, (double)age);
            long f = below(p->freq_edges, p->n_freq, rate * (double)E / (double)p->K);
            long base = a * p->NF + f;
            double prior = p->prior_w * at_most_one(rate);
            out[not_used * E + e] = (p->hits[base] + prior) / (p->trials[base] + p->prior_w);
        }
    }
}

/* Predictor._score_guess without numpy's argpartition: how many of `used` are among the k = min(K,
 * E) experts of highest P[i]; -1 where the k-th and the next are equal (which ones argpartition
 * takes among them is its own affair) */
static long guessed(const pred_t *p, long i, const long *used, long n_used) {
    long E = p->E, k = p->K < E ? p->K : E, n = 0, hits = 0;
    if (k == E) return n_used;
    const double *P = p->P + i * E;
    for (long e = 0; e < E; e++) keep_best(p->score, p->order, &n, k + 1, P[e], e);
    if (!(p->score[k - 1] > p->score[k])) return -1;
    for (long u = 0; u < n_used; u++) hits += P[used[u]] >= p->score[k - 1];
    return hits;
}

/* Predictor.visit: layer i's visit as the planner makes it, in one call. Its row refreshed first
 * (VISIT_REFRESH) and its top-k guess scored (unless VISIT_GUESSED: the caller has), its visit
 * counted (hm_pred_count_use; VISIT_BAND: it has a cross-layer score), the next layer's router
 * buckets from p->probs (VISIT_ROUTER), the cross-layer pairs learnt and the next layers'
 * bands (with horizons), each changed row's version bumped as Predictor._stale does, and last
 * the rows it changed and those stale before, p->rows[0..nstale), refreshed. used: row i of
 * p->used. Returns the guess's hits (0 with VISIT_GUESSED), or -1, having changed nothing but
 * the refresh, where the guess is tied (the caller scores it and calls again with
 * VISIT_GUESSED). */
enum { VISIT_REFRESH = 1, VISIT_BAND = 2, VISIT_ROUTER = 4, VISIT_GUESSED = 8 };
long hm_pred_visit(const pred_t *p, long i, long n_used, int flags, long nstale) {
    long L = p->L, E = p->E, hits = 0, last = i; /* rows i..last changed */
    const long *used = p->used + i * E;
    if (flags & VISIT_REFRESH) hm_pred_refresh(p, &i, 1);
    if (!(flags & VISIT_GUESSED) && (hits = guessed(p, i, used, n_used)) < 0) return -1;
    hm_pred_count_use(p, i, used, n_used, (flags & VISIT_BAND) != 0);
    p->row_version[i]++;
    if ((flags & VISIT_ROUTER) && i + 1 < L) {
        hm_pred_router(p, i + 1, p->probs, p->order);
        p->row_version[i + 1]++;
        last = i + 1;
    }
    if (p->H > 0) {
        hm_pred_learn(p, i, used, n_used);
        p->n_set[i] = n_used;
        hm_pred_bands(p, i, used, n_used, p->score);
        for (long h = 1; h <= p->H && i + h < L; h++) p->row_version[i + h]++;
        last = i + p->H < L ? i + p->H : L - 1;
        last = last > i ? last : i;
    }
    hm_pred_refresh(p, p->rows, nstale);
    for (long j = i; j <= last; j++) {
        int done = 0; /* refreshed already as one of the stale rows */
        for (long r = 0; r < nstale; r++) done |= p->rows[r] == j;
        if (!done) hm_pred_refresh(p, &j, 1);
    }
    return hits;
}

/* (score, flat key) of a before that of b: the ranking's total order, ties by key */
static int ranks_before(const double *score, const long *flat, long a, long b) {
    return score[a] < score[b] || (score[a] == score[b] && flat[a] < flat[b]);
}

/* The positions 0..n-1 by ascending (score, flat), into idx (tmp: n more longs): a merge sort,
 * np.lexsort((flat, score)) */
void hm_rank(const double *score, const long *flat, long n, long *idx, long *tmp) {
    for (long x = 0; x < n; x++) idx[x] = x;
    for (long w = 1; w < n; w *= 2) {
        for (long lo = 0; lo < n; lo += 2 * w) {
            long mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            long a = lo, b = mid, o = lo;
            while (a < mid && b < hi)
                tmp[o++] = ranks_before(score, flat, idx[b], idx[a]) ? idx[b++] : idx[a++];
            while (a < mid) tmp[o++] = idx[a++];
            while (b < hi) tmp[o++] = idx[b++];
        }
        memcpy(idx, tmp, n * sizeof(long));
    }
}

/* The positions of the `first` lowest (score, flat) of n, in order, into idx; returns how many
 * (min(first, n)): hm_rank's head without sorting the rest */
long hm_rank_head(const double *score, const long *flat, long n, long first, long *idx) {
    long m = 0;
    double last = 0.0; /* the score and key of the last kept, once `first` are */
    long last_key = 0;
    for (long x = 0; x < n; x++) {
        if (m == first && !(score[x] < last || (score[x] == last && flat[x] < last_key)))
            continue;
        long at = m < first ? m++ : first - 1;
        while (at > 0 && ranks_before(score, flat, x, idx[at - 1])) {
            idx[at] = idx[at - 1];
            at--;
        }
        idx[at] = x;
        if (m == first) {
            last = score[idx[m - 1]];
            last_key = flat[idx[m - 1]];
        }
    }
    return m;
}

/* ValuePolicy.background_in's candidates of the layer ordinals rows[0..nrows): each layer's k
 * experts of highest p_next, residents (mask) counted as -inf, ties by expert id (np.argsort(-p,
 * kind="stable")[:k]), into cand[i * k ...] */
static void value_cand(const pred_t *p, const uint8_t *mask, const long *rows, long nrows, long k,
                   long *cand) {
    long E = p->E;
    double best[k > 0 ? k : 1];
    for (long r = 0; r < nrows; r++) {
        long i = rows[r], n = 0;
        for (long e = 0; e < E; e++)
            keep_best(best, cand + i * k, &n, k, mask[i * E + e] ? -1.0 / 0.0 : p->P[i * E + e], e);
    }
}

/* ---- the value policy's state, named once (predictor_kernels.BoundValue) ----------------------- */

typedef struct {
    const pred_t *p;
    const uint8_t *mask, *pinned; /* [L, E] each: the cache's resident and pinned keys */
    const int64_t *cache_version; /* [L]: bumped when a layer's residents change */
    int64_t *seen;                /* [2, L]: the (predictor, cache) versions each row's candidates
                                     were made at */
    long *cand, k;                /* [L, k]: each layer's candidates */
    long *flat;                   /* [L * E]: keys (ordinal * E + expert), in no order */
    double *score;                /* [L * E]: their scores */
    long *idx, *tmp;              /* [L * E] each: a ranking's positions, and scratch */
    long *out;                    /* [L * E]: keys ranked */
    double *D;                    /* [L * E]: their scores */
    double *after;                /* [2, E]: hm_pred_after_visit's */
    const int64_t *slot_flat;     /* [n_slots]: the cache's keys by slot (-1: none) */
    long n_slots;
} value_t;

/* ValuePolicy._make_view's ranking keys: the dynamic residents (the keys in the cache's slots, not
 * pinned), in slot order, as flat keys (out) and minus their distance (neg): d + L (1 - p) / q,
 * d the layers from ordinal `here` on until theirs runs (L for itself), p and q floored at 1e-3,
 * where `here`'s residents read p_not for both (unless p_not is NULL). Returns their number. */
static long residents_by(const value_t *v, long here, const double *p_not, long *out,
                         double *neg) {
    const pred_t *p = v->p;
    long E = p->E, L = p->L, n = 0;
    double per_row = 1.0 / (double)E;
    for (long s = 0; s < v->n_slots; s++) {
        long x = v->slot_flat[s];
        if (x < 0 || v->pinned[x]) continue;
        long i = (long)((double)x * per_row); /* x / E, without an integer division */
        i -= i * E > x;
        i += (i + 1) * E <= x;
        long e = x - i * E, d = i - here;
        d += (d <= 0) * L;
        int sub = i == here && p_not != NULL;
        double P = sub ? p_not[e] : p->P[x], Q = sub ? p_not[e] : p->Q[x];
        double pp = P > 1e-3 ? P : 1e-3, qq = Q > 1e-3 ? Q : 1e-3;
        out[n] = x;
        neg[n++] = -((double)d + (double)L * (1.0 - pp) / qq);
    }
    return n;
}

/* ValuePolicy.background_in in one call: the candidates of the layer ordinals rows[0..nrows)
 * (ascending; every layer where rows is NULL) made afresh where the layer's predictor or cache
 * row changed since (value_cand), their keys and distances (d + L (1 - p) / q with p, q floored at
 * 1e-3, d the layers from ordinal `here` on until the layer runs, L for itself, plus L where a
 * copy ready at `arrive` misses that visit: arrive > now + d * period, with period > 0; with top_only,
 * only the keys the router ranks among its layer's top-k, bucket 3), ranked by (distance, key)
 * into v->out and v->D. Returns their number. */
long hm_value_background(const value_t *v, const long *rows, long nrows, int top_only, long here,
                         double now, double arrive, double period) {
    const pred_t *p = v->p;
    long L = p->L, E = p->E, k = v->k, n = 0, count = rows ? nrows : L;
    for (long r = 0; r < count; r++) {
        long i = rows ? rows[r] : r;
        int64_t pv = p->row_version[i], cv = v->cache_version[i];
        if (v->seen[i] == pv && v->seen[L + i] == cv) continue;
        v->seen[i] = pv;
        v->seen[L + i] = cv;
        value_cand(p, v->mask, &i, 1, k, v->cand);
    }
    for (long r = 0; r < count; r++) {
        long i = rows ? rows[r] : r;
        long d = ((i - here) % L + L) % L;
        d = d ? d : L;
        if (period > 0 && arrive > now + (double)d * period) d += L;
        for (long c = 0; c < k; c++) {
            long x = i * E + v->cand[i * k + c];
            if (v->mask[x] || (top_only && p->router[x] != 3)) continue;
            double pp = p->P[x] > 1e-3 ? p->P[x] : 1e-3, qq = p->Q[x] > 1e-3 ? p->Q[x] : 1e-3;
            v->flat[n] = x;
            v->score[n++] = (double)d + (double)L * (1.0 - pp) / qq;
        }
    }
    hm_rank(v->score, v->flat, n, v->idx, v->tmp);
    for (long j = 0; j < n; j++) {
        v->out[j] = v->flat[v->idx[j]];
        v->D[j] = v->score[v->idx[j]];
    }
    return n;
}

/* ValuePolicy._make_view in one call: with_after, layer `here`'s probabilities after its coming
 * visit into v->after (hm_pred_after_visit) and its residents scored with the not-used ones;
 * every dynamic resident into v->flat and minus its distance into v->score (residents_by), the
 * positions of the `first` ranked lowest by (score, key) into v->idx (hm_rank_head). Returns the
 * residents' number. */
long hm_value_view(const value_t *v, long here, int with_after, long first) {
    if (with_after) hm_pred_after_visit(v->p, here, v->after);
    const double *p_not = with_after ? v->after + v->p->E : NULL;
    long n = residents_by(v, here, p_not, v->flat, v->score);
    hm_rank_head(v->score, v->flat, n, first, v->idx);
    return n;
}
