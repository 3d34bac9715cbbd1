/* The planner's split of one layer (hybridmoe/experts/plan/planner.py, Planner._best_split and
 * _late_choices) in C: which in-flight experts and how many leading copy options run on the GPU.
 * The same arithmetic in the same order as the Python, so that every cost comes out the same bits
 * (built with -ffp-contract=off, no fast-math) and every tie breaks the same way. */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const double *cpu, *gpu; /* [n_table]: seconds of one expert taking n tokens, by n */
    long n_table;
    double t_copy, slowdown;  /* a copy's seconds; CPU work's slowdown while copies stream */
    double row, fixed;        /* the activation round trip: seconds per row, per layer */
    long late_subsets;        /* in-flight experts up to which every split of them is weighed */
} split_t;

/* one way to split the in-flight experts: GPU end, CPU seconds, CPU rows, which on the GPU
 * (a bit per expert; beyond late_subsets, how many leading ones) */
typedef struct {
    double gpu, cpu;
    long rows;
    uint64_t on;
} point_t;

/* Python's max(a, b): a unless b is larger */
static double max2(double a, double b) { return b > a ? b : a; }

/* the tuple order of (gpu, cpu, rows) */
static int before(const point_t *a, const point_t *b) {
    if (a->gpu != b->gpu) return a->gpu < b->gpu;
    if (a->cpu != b->cpu) return a->cpu < b->cpu;
    return a->rows < b->rows;
}

/* points sorted by (gpu, cpu, rows), ties in their order (list.sort is stable); tmp: n more */
static void sort_points(point_t *pts, long n, point_t *tmp) {
    for (long w = 1; w < n; w *= 2) {
        for (long lo = 0; lo < n; lo += 2 * w) {
            long mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            long a = lo, b = mid, o = lo;
            while (a < mid && b < hi) tmp[o++] = before(&pts[b], &pts[a]) ? pts[b++] : pts[a++];
            while (a < mid) tmp[o++] = pts[a++];
            while (b < hi) tmp[o++] = pts[b++];
        }
        for (long i = 0; i < n; i++) pts[i] = tmp[i];
    }
}

/* planner._undominated: the sorted points none kept before beats or ties on CPU and rows */
static long undominated(point_t *pts, long n, point_t *out, point_t *tmp) {
    sort_points(pts, n, tmp);
    long kept = 0;
    for (long i = 0; i < n; i++) {
        int beaten = 0;
        for (long j = 0; j < kept && !beaten; j++)
            beaten = out[j].cpu <= pts[i].cpu && out[j].rows <= pts[i].rows;
        if (!beaten) out[kept++] = pts[i];
    }
    return kept;
}

/* Planner._late_choices into front (room for 2 << n_late points exactly, n_late + 1 beyond);
 * work: 4 << n_late more points when exact. The number of points. */
static long late_choices(const split_t *s, double start, long n_late, const long *tokens,
                         const double *ready, point_t *front, point_t *work) {
    long n = 1;
    front[0] = (point_t){start, 0.0, 0, 0};
    int exact = n_late <= s->late_subsets;
    for (long j = 0; j < n_late; j++) {
        double g = s->gpu[tokens[j]], t = s->cpu[tokens[j]];
        if (!exact) { /* prefixes: the first a on the GPU, the rest on the CPU */
            point_t last = front[n - 1];
            front[n] = (point_t){max2(last.gpu, ready[j]) + g, last.cpu, last.rows, n};
            n++;
            continue;
        }
        point_t *grown = work, *tmp = work + 2 * n;
        for (long i = 0; i < n; i++) {
            point_t p = front[i];
            grown[i] = (point_t){max2(p.gpu, ready[j]) + g, p.cpu, p.rows, p.on | (1ull << j)};
            grown[n + i] = (point_t){p.gpu, p.cpu + t, p.rows + tokens[j], p.on};
        }
        n = undominated(grown, 2 * n, front, tmp);
    }
    if (!exact) { /* each prefix's CPU share: the seconds and rows of the experts after it */
        long rows = 0;
        for (long a = n_late; a >= 0; a--) {
            if (a < n_late) rows = tokens[a] + rows;
            double cpu = 0.0;
            for (long j = a; j < n_late; j++) cpu += s->cpu[tokens[j]];
            front[a].cpu = cpu;
            front[a].rows = rows;
        }
    }
    return n;
}

/* _Times.cpu_beside_copies */
static double beside(double slow, double work, double copying) {
    if (copying <= 0 || slow == 1.0) return work;
    if (work * slow <= copying) return work * slow;
    return work + copying * (1.0 - 1.0 / slow);
}

/* Planner._best_split over `front`: the best (makespan - value) in *cost, its point in *point;
 * returns b, the leading options copied. opt: tokens [n_opt]; gain [n_opt]; base_cpu: every
 * option's and stranded expert's CPU seconds; rows: the options' suffix sums [n_opt + 1]. */
static long best_of(const split_t *s, double now, double copy_start, long tokens,
                    const point_t *front, long n_front, long n_opt, const long *opt,
                    const double *gain, double base_cpu, const long *rows, long stranded_rows,
                    double *cost_out, long *point) {
    double best_cost = 1.0 / 0.0;
    long best_b = 0;
    *point = -1;
    for (long f = 0; f < n_front; f++) {
        double gpu = front[f].gpu, cpu = base_cpu + front[f].cpu, gained = 0.0;
        long rows_a = front[f].rows + stranded_rows;
        for (long b = 0; b <= n_opt; b++) {
            double busy = copy_start + (double)b * s->t_copy - now;
            if (b) {
                gpu = max2(gpu, now + busy) + s->gpu[opt[b - 1]];
                cpu -= s->cpu[opt[b - 1]];
                gained += gain[b - 1];
            }
            long r = rows_a + rows[b];
            double cpu_end = now;
            if (r) {
                long up = r < tokens ? r : tokens;
                double act = (double)(up + r) * s->row + s->fixed; /* _Times.act */
                cpu_end = now + (beside(s->slowdown, cpu, busy) + act);
            }
            double cost = max2(cpu_end, gpu) - gained;
            if (cost < best_cost - 1e-12) {
                best_cost = cost;
                best_b = b;
                *point = f;
            }
        }
    }
    *cost_out = best_cost;
    return best_b;
}

/* Planner._best_split: which in-flight experts and how many leading copy options go to the GPU.
 * n: [tokens, n_hits, n_late, n_opt, n_str] (the layer's token rows; how many GPU hits, in-flight
 * experts soonest ready first, copy options in order, misses left on the CPU), then their token
 * counts in that order; x: [now, copy_free], then the in-flight experts' ready times [n_late], the
 * options' gains [n_opt]. Writes out[0] = makespan - value, out[1] = the in-flight experts on the
 * GPU (a bit each; beyond late_subsets, how many leading ones); returns b, or -1 where it cannot
 * run (memory, a token count past the table). */
long hm_best_split(const split_t *s, const long *n, const double *x, double *out) {
    long tokens = n[0], n_hits = n[1], n_late = n[2], n_opt = n[3], n_str = n[4];
    const long *tok = n + 5;
    double now = x[0], copy_free = x[1];
    const double *ready = x + 2, *gain = ready + n_late;
    for (long i = 0; i < n_hits + n_late + n_opt + n_str; i++)
        if (tok[i] < 0 || tok[i] >= s->n_table) return -1;
    int exact = n_late <= s->late_subsets;
    if (exact && n_late > 20) return -1;
    long room = exact ? 2l << n_late : n_late + 1;
    point_t *front = malloc(sizeof(point_t) * (exact ? 3 * room : room));
    long *rows = malloc(sizeof(long) * (n_opt + 1));
    if (!front || !rows) {
        free(front);
        free(rows);
        return -1;
    }
    const long *late = tok + n_hits, *opt = late + n_late, *str = opt + n_opt;
    double hits = 0.0;
    for (long i = 0; i < n_hits; i++) hits += s->gpu[tok[i]];
    long n_front = late_choices(s, now + hits, n_late, late, ready, front, front + room);
    double opt_cpu = 0.0, str_cpu = 0.0;
    long str_rows = 0;
    for (long i = 0; i < n_opt; i++) opt_cpu += s->cpu[opt[i]];
    for (long i = 0; i < n_str; i++) {
        str_cpu += s->cpu[str[i]];
        str_rows += str[i];
    }
    rows[n_opt] = 0;
    for (long i = n_opt - 1; i >= 0; i--) rows[i] = opt[i] + rows[i + 1];
    long point;
    long b = best_of(s, now, max2(now, copy_free), tokens, front, n_front, n_opt, opt, gain,
                     opt_cpu + str_cpu, rows, str_rows, &out[0], &point);
    out[1] = point < 0 ? 0.0 : (double)front[point].on;
    free(front);
    free(rows);
    return b;
}
