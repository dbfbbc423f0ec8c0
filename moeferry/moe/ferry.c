/* The ferry's host thread (moeferry/moe/ferry.py): experts moved from pinned host banks into
 * device cache slots by the copy engine, at the request of a decode step running in a CUDA graph.
 *
 * A step posts a box: the mailbox row [ready, n, -, -, (src slot, dst slot) x max_pairs] in
 * pinned host memory, written by a kernel (`ferry_signal.post`). The thread spins over the
 * ready words; for each posted box it queues, on the box's stream, one copy per slot tensor
 * per pair whose destination is not negative (the parts of the box's plan: bank base and slot
 * stride -> cache base and slot stride, bytes), then a copy of the word 1 into the box's done
 * word on the device, which the step's `ferry_signal.wait` kernel spins on. Copies go through
 * `copy` (cuMemcpyHtoDAsync on CUDA, memcpy on the CPU, where tests run the same protocol).
 *
 * A copy that fails is recorded (`ferry_error`) and the done word is written all the same: the
 * device never waits for a box that will not come; the caller checks the error after the step.
 * Idle longer than `idle_ns`, the thread sleeps 50 us between scans instead of spinning.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*copy_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*ctx_fn)(void *ctx);

enum { HEADER = 4 };  /* words before a box's pairs: ready, n, two unused */

typedef struct {
    uint64_t src, src_stride, dst, dst_stride, bytes;
} Part;

typedef struct {
    Part *parts;
    int n_parts, src_slots, dst_slots;
    void *stream;
    uint64_t done;  /* device address of the box's done word */
} Plan;

typedef struct {
    volatile int32_t *boxes;
    int n_boxes, max_pairs;
    Plan *plans;
    const int32_t *one;
    copy_fn copy;
    ctx_fn set_ctx;
    void *ctx;
    int64_t idle_ns;
    pthread_t thread;
    pthread_mutex_t lock;
    int running;
    volatile int stop;
    volatile int64_t error, moved, bytes, posts;
} Ferry;

int ferry_host_copy(uint64_t dst, const void *src, size_t n, void *stream) {
    (void)stream;
    memcpy((void *)(uintptr_t)dst, src, n);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 0;
}

int ferry_no_ctx(void *ctx) {
    (void)ctx;
    return 0;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void fail(Ferry *f, int64_t code) {
    if (f->error == 0) f->error = code;
}

static void move_box(Ferry *f, int b) {
    volatile int32_t *box = f->boxes + (size_t)b * (HEADER + 2 * f->max_pairs);
    Plan *p = &f->plans[b];
    int n = box[1];
    if (n < 0 || n > f->max_pairs) {
        fail(f, -1000 - b);
        n = 0;
    }
    for (int i = 0; i < n; i++) {
        int32_t src = box[HEADER + 2 * i], dst = box[HEADER + 2 * i + 1];
        if (dst < 0) continue;
        if (src < 0 || src >= p->src_slots || dst >= p->dst_slots) {
            fail(f, -2000 - b);
            continue;
        }
        for (int k = 0; k < p->n_parts; k++) {
            Part *q = &p->parts[k];
            int rc = f->copy(q->dst + (uint64_t)dst * q->dst_stride,
                             (const void *)(uintptr_t)(q->src + (uint64_t)src * q->src_stride), q->bytes, p->stream);
            if (rc) fail(f, rc);
            f->bytes += (int64_t)q->bytes;
        }
        f->moved++;
    }
    int rc = p->done ? f->copy(p->done, f->one, sizeof(int32_t), p->stream) : -3000 - b;
    if (rc) fail(f, rc);
    f->posts++;
}

static void *run(void *arg) {
    Ferry *f = arg;
    if (f->set_ctx(f->ctx)) fail(f, -1);
    size_t words = HEADER + 2 * (size_t)f->max_pairs;
    int64_t last = now_ns();
    while (!f->stop) {
        int worked = 0;
        for (int b = 0; b < f->n_boxes; b++) {
            if (f->boxes[b * words] == 0) continue;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            f->boxes[b * words] = 0;  /* the step posts this box again only after its done word */
            pthread_mutex_lock(&f->lock);
            move_box(f, b);
            pthread_mutex_unlock(&f->lock);
            worked = 1;
        }
        if (worked) {
            last = now_ns();
        } else if (now_ns() - last > f->idle_ns) {
            struct timespec nap = {0, 50000};
            nanosleep(&nap, NULL);
        }
    }
    return NULL;
}

Ferry *ferry_new(int32_t *boxes, int n_boxes, int max_pairs, const int32_t *one, copy_fn copy, ctx_fn set_ctx,
                 void *ctx, int64_t idle_ns) {
    Ferry *f = calloc(1, sizeof(Ferry));
    if (!f) return NULL;
    f->plans = calloc((size_t)n_boxes, sizeof(Plan));
    if (!f->plans) {
        free(f);
        return NULL;
    }
    f->boxes = boxes;
    f->n_boxes = n_boxes;
    f->max_pairs = max_pairs;
    f->one = one;
    f->copy = copy;
    f->set_ctx = set_ctx;
    f->ctx = ctx;
    f->idle_ns = idle_ns;
    pthread_mutex_init(&f->lock, NULL);
    return f;
}

/* Box `b`'s plan: `n_parts` parts of five words each (src, src_stride, dst, dst_stride, bytes). */
int ferry_plan(Ferry *f, int b, int n_parts, const uint64_t *parts, int src_slots, int dst_slots, void *stream,
               uint64_t done) {
    if (b < 0 || b >= f->n_boxes) return -1;
    Part *copy = malloc((size_t)(n_parts ? n_parts : 1) * sizeof(Part));
    if (!copy) return -2;
    memcpy(copy, parts, (size_t)n_parts * sizeof(Part));
    pthread_mutex_lock(&f->lock);
    Plan *p = &f->plans[b];
    free(p->parts);
    p->parts = copy;
    p->n_parts = n_parts;
    p->src_slots = src_slots;
    p->dst_slots = dst_slots;
    p->stream = stream;
    p->done = done;
    pthread_mutex_unlock(&f->lock);
    return 0;
}

int ferry_start(Ferry *f) {
    if (f->running) return 0;
    f->stop = 0;
    if (pthread_create(&f->thread, NULL, run, f)) return -1;
    f->running = 1;
    return 0;
}

void ferry_stop(Ferry *f) {
    if (!f->running) return;
    f->stop = 1;
    pthread_join(f->thread, NULL);
    f->running = 0;
}

void ferry_free(Ferry *f) {
    ferry_stop(f);
    for (int b = 0; b < f->n_boxes; b++) free(f->plans[b].parts);
    free(f->plans);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

/* error, experts moved, bytes moved, boxes served */
void ferry_counts(Ferry *f, int64_t *out) {
    out[0] = f->error;
    out[1] = f->moved;
    out[2] = f->bytes;
    out[3] = f->posts;
}
