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
} pred_t;

/* np.searchsorted(edges, v, "left"): the edges below v */
static long below(const double *edges, long n, double v) {
    long a = 0;
    while (a < n && edges[a] < v) a++;
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

/* the ids 0..E-1 by descending probs, ties by id: np.argsort(-probs, kind="stable") (a merge
 * sort; tmp: E more longs) */
static void by_descending(const double *probs, long E, long *order, long *tmp) {
    for (long e = 0; e < E; e++) order[e] = e;
    for (long w = 1; w < E; w *= 2) {
        for (long lo = 0; lo < E; lo += 2 * w) {
            long mid = lo + w < E ? lo + w : E, hi = lo + 2 * w < E ? lo + 2 * w : E;
            long a = lo, b = mid, o = lo;
            while (a < mid && b < hi) /* the left one on ties: stable */
                tmp[o++] = -probs[order[b]] < -probs[order[a]] ? order[b++] : order[a++];
            while (a < mid) tmp[o++] = order[a++];
            while (b < hi) tmp[o++] = order[b++];
        }
        memcpy(order, tmp, E * sizeof(long));
    }
}

/* Predictor.set_router_scores: rank < k: 3, < 2k: 2, else 1 (order: 2E longs of scratch) */
void hm_pred_router(const pred_t *p, long i, const double *probs, long *order) {
    long E = p->E, K = p->K;
    by_descending(probs, E, order, order + E);
    intptr_t *row = p->router + i * E;
    for (long r = 0; r < E; r++) row[order[r]] = r < K ? 3 : (r < 2 * K ? 2 : 1);
}

/* CrossLayer.learn: layer i used `used`; src[h] (n_src[h] of them, or none) is what layer i-h-1
 * used at this step, for horizon index h */
void hm_pred_learn(const pred_t *p, long i, const long *used, long n_used, const long *const *src,
                   const long *n_src) {
    long L = p->L, E = p->E;
    for (long h = 0; h < p->H; h++) {
        long from = i - (h + 1);
        if (from < 0 || src[h] == NULL || n_src[h] == 0) continue;
        double *scale = p->scale + h * L + from;
        double *co = p->co + (h * L + from) * E * E, *n = p->n + (h * L + from) * E;
        *scale *= p->cross_keep;
        if (*scale < 1e-150) { /* fold the scale in before it underflows */
            for (long x = 0; x < E * E; x++) co[x] *= *scale;
            for (long x = 0; x < E; x++) n[x] *= *scale;
            *scale = 1.0;
        }
        double one = 1.0 / *scale;
        for (long a = 0; a < n_src[h]; a++) {
            double *row = co + src[h][a] * E;
            for (long u = 0; u < n_used; u++) row[used[u]] += one;
            n[src[h][a]] += one;
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

/* ValuePolicy._make_view's ranking keys: the dynamic residents (resident, not pinned), in
 * row-major order, as flat indices (out) and minus their distance (neg): d + L (1 - p) / q, d the
 * layers from ordinal `here` on until theirs runs (L for itself), p and q floored at 1e-3, where
 * `here`'s residents read p_not for both (unless p_not is NULL). Returns their number. */
long hm_pred_view(const pred_t *p, const uint8_t *mask, const uint8_t *pinned, long here,
                  const double *p_not, long *out, double *neg) {
    long n = 0, E = p->E, L = p->L;
    for (long i = 0; i < L; i++) {
        long d = ((i - here) % L + L) % L;
        double dist = (double)(d ? d : L);
        int sub = i == here && p_not != NULL;
        const double *P = sub ? p_not : p->P + i * E, *Q = sub ? p_not : p->Q + i * E;
        for (long e = 0; e < E; e++) {
            long x = i * E + e;
            if (!mask[x] || pinned[x]) continue;
            double pp = P[e] > 1e-3 ? P[e] : 1e-3, qq = Q[e] > 1e-3 ? Q[e] : 1e-3;
            out[n] = x;
            neg[n++] = -(dist + (double)L * (1.0 - pp) / qq);
        }
    }
    return n;
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
    for (long x = 0; x < n; x++) {
        if (m == first && !ranks_before(score, flat, x, idx[m - 1])) continue;
        long at = m < first ? m++ : first - 1;
        while (at > 0 && ranks_before(score, flat, x, idx[at - 1])) {
            idx[at] = idx[at - 1];
            at--;
        }
        idx[at] = x;
    }
    return m;
}

/* ValuePolicy.background's candidates of the layer ordinals rows[0..nrows): each layer's k experts
 * of highest p_next, residents (mask) counted as -inf, ties by expert id (np.argsort(-p,
 * kind="stable")[:k]), into cand[i * k ...] */
void hm_value_cand(const pred_t *p, const uint8_t *mask, const long *rows, long nrows, long k,
                   long *cand) {
    long E = p->E;
    double best[k > 0 ? k : 1];
    for (long r = 0; r < nrows; r++) {
        long i = rows[r], *out = cand + i * k, n = 0;
        for (long e = 0; e < E; e++) {
            double v = mask[i * E + e] ? -1.0 / 0.0 : p->P[i * E + e];
            if (n == k && !(v > best[k - 1])) continue; /* an equal one came first */
            long at = n < k ? n++ : k - 1;
            while (at > 0 && v > best[at - 1]) {
                best[at] = best[at - 1];
                out[at] = out[at - 1];
                at--;
            }
            best[at] = v;
            out[at] = e;
        }
    }
}

/* ValuePolicy.background's keys: of the candidates cand [L, k] of the layer ordinals rows[0..nrows)
 * (ascending), those not resident, as flat keys
 * (ordinal * E + expert) into out, their expected distances into D; returns their number.
 * Distance: d + L (1 - p) / q with p, q floored at 1e-3, d the layers from ordinal `here` on
 * until the layer runs (L for itself), plus L where a copy ready at `arrive` misses that visit
 * (arrive > now + d * period; only with period > 0). */
long hm_value_keys(const pred_t *p, const uint8_t *mask, const long *cand, const long *rows,
                   long nrows, long k, long here, double now, double arrive, double period,
                   long *out, double *D) {
    long L = p->L, E = p->E, n = 0;
    for (long r = 0; r < nrows; r++) {
        long i = rows[r];
        for (long c = 0; c < k; c++) {
            long x = i * E + cand[i * k + c];
            if (mask[x]) continue;
            long d = ((i - here) % L + L) % L;
            d = d ? d : L;
            if (period > 0 && arrive > now + (double)d * period) d += L;
            double pp = p->P[x] > 1e-3 ? p->P[x] : 1e-3, qq = p->Q[x] > 1e-3 ? p->Q[x] : 1e-3;
            out[n] = x;
            D[n++] = (double)d + (double)L * (1.0 - pp) / qq;
        }
    }
    return n;
}
