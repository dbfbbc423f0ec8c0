/* The CPU lane of hybrid decode steps that run whole in a CUDA graph (moeferry/moe/cpu_lane.py).
 *
 * Each MoE layer with a cache has a box in pinned host memory. A step's split kernel
 * (moeferry/ops/triton/lane_signal.py) writes the layer's rows into its box (x in fp32, the
 * (token, choice) expert ids with -1 for the pairs not on this lane, the routing weights), then,
 * after a system-wide fence, the box's `posted` words: [sequence, rows], the sequence one more at
 * each post. This thread spins over the boxes; for a box posted past the sequence it served last,
 * it computes the pairs' experts (the C kernel of moeferry/ops/cpu/experts.c, called through its
 * function pointer, with this thread's own OpenMP team) into the box's output, and then (after a
 * release fence) writes the sequence into the box's `served` words: [sequence, failed]. The step's
 * collect kernel spins on that word before it adds the output.
 *
 * The thread makes no CUDA call: nothing the host does with the device can hold it up (a thread
 * that queued copies through the driver could be blocked behind the main thread's calls while a
 * graph waited on it). Idle longer than `idle_ns`, it sleeps 50 us between scans.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*experts_fn)(const void *gu, const void *dn, const float *x, int tokens, int top_k,
                          const int64_t *ids, const float *weights, const int32_t *table, int num_experts,
                          float *out, int threads);

enum { WORDS = 4 };  /* words a box's posted and served rows hold */

typedef struct {
    volatile int32_t *posted, *served;     /* [boxes, WORDS] */
    const int64_t *ids;                    /* [boxes, pairs] */
    const float *weights;                  /* [boxes, pairs] */
    const float *x;                        /* [boxes, rows, hidden] */
    float *out;                            /* [boxes, rows, hidden] */
    const void *const *banks;              /* [boxes, 2]: each box's gate_up and down matrix views */
    const int32_t *table;                  /* [num_experts]: expert e -> bank slot e */
    int n_boxes, max_rows, hidden, top_k, num_experts, threads;
    experts_fn run;
    int64_t idle_ns;
    int32_t *seen;                         /* [boxes]: the sequence served last */
    volatile int64_t busy_ns, experts, pairs;  /* time spent computing boxes, and what they held */
    pthread_t thread;
    int running;
    volatile int stop;
    volatile int64_t failures, boxes_served;
} Lane;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* (distinct experts, pairs) among a box's n pairs (ids -1: not this lane's). */
static void count(const int64_t *ids, int n, int64_t *experts, int64_t *pairs) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0) continue;
        int first = 1;
        for (int j = 0; j < i && first; j++) first = ids[j] != ids[i];
        *experts += first;
        *pairs += 1;
    }
}

static void serve(Lane *l, int b, int32_t seq) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    volatile int32_t *posted = l->posted + (size_t)b * WORDS, *served = l->served + (size_t)b * WORDS;
    int rows = posted[1], failed = 0;
    if (rows < 0 || rows > l->max_rows) {
        rows = 0;
        failed = 1;
    }
    size_t row_floats = (size_t)l->max_rows * l->hidden, pairs = (size_t)l->max_rows * l->top_k;
    float *out = l->out + (size_t)b * row_floats;
    const int64_t *ids = l->ids + (size_t)b * pairs;
    int64_t start = now_ns(), experts = 0, n_pairs = 0;
    memset(out, 0, sizeof(float) * (size_t)rows * l->hidden);
    if (rows > 0) {
        failed |= l->run(l->banks[2 * b], l->banks[2 * b + 1], l->x + (size_t)b * row_floats, rows, l->top_k, ids,
                         l->weights + (size_t)b * pairs, l->table, l->num_experts, out, l->threads) != 0;
        count(ids, rows * l->top_k, &experts, &n_pairs);
    }
    __atomic_store_n(&l->busy_ns, l->busy_ns + now_ns() - start, __ATOMIC_RELAXED);
    __atomic_store_n(&l->experts, l->experts + experts, __ATOMIC_RELAXED);
    __atomic_store_n(&l->pairs, l->pairs + n_pairs, __ATOMIC_RELAXED);
    if (failed) l->failures++;
    served[1] = failed;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    served[0] = seq;
    l->seen[b] = seq;
    l->boxes_served++;
}

static void *run(void *arg) {
    Lane *l = arg;
    int64_t last = now_ns();
    while (!l->stop) {
        int worked = 0;
        for (int b = 0; b < l->n_boxes; b++) {
            int32_t seq = l->posted[(size_t)b * WORDS];
            if (seq == l->seen[b]) continue;
            serve(l, b, seq);
            worked = 1;
        }
        if (worked) {
            last = now_ns();
        } else if (now_ns() - last > l->idle_ns) {
            struct timespec nap = {0, 50000};
            nanosleep(&nap, NULL);
        }
    }
    return NULL;
}

Lane *lane_new(int32_t *posted, int32_t *served, const int64_t *ids, const float *weights, const float *x, float *out,
               const void *const *banks, const int32_t *table, int n_boxes, int max_rows, int hidden, int top_k,
               int num_experts, void *run_fn, int threads, int64_t idle_ns) {
    Lane *l = calloc(1, sizeof(Lane));
    if (!l) return NULL;
    l->seen = calloc((size_t)n_boxes, sizeof(int32_t));
    if (!l->seen) {
        free(l);
        return NULL;
    }
    for (int b = 0; b < n_boxes; b++) l->seen[b] = posted[(size_t)b * WORDS];
    l->posted = posted, l->served = served, l->ids = ids, l->weights = weights, l->x = x, l->out = out;
    l->banks = banks, l->table = table, l->n_boxes = n_boxes, l->max_rows = max_rows, l->hidden = hidden;
    l->top_k = top_k, l->num_experts = num_experts, l->run = (experts_fn)run_fn, l->threads = threads;
    l->idle_ns = idle_ns;
    return l;
}

int lane_start(Lane *l) {
    if (l->running) return 0;
    l->stop = 0;
    if (pthread_create(&l->thread, NULL, run, l)) return -1;
    l->running = 1;
    return 0;
}

void lane_stop(Lane *l) {
    if (!l->running) return;
    l->stop = 1;
    pthread_join(l->thread, NULL);
    l->running = 0;
}

void lane_free(Lane *l) {
    lane_stop(l);
    free(l->seen);
    free(l);
}

/* Boxes whose computation failed (out of memory, or rows out of range), boxes served, and since the
 * start: nanoseconds spent serving boxes, the experts and the (token, expert) pairs they computed. */
void lane_counts(Lane *l, int64_t *out) {
    out[0] = l->failures;
    out[1] = l->boxes_served;
    out[2] = __atomic_load_n(&l->busy_ns, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&l->experts, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&l->pairs, __ATOMIC_RELAXED);
}
