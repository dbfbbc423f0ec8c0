/* The ferry's host thread (moeferry/moe/ferry.py): experts moved from pinned host banks into
 * device cache slots by the copy engine, at the request of a decode step running in a CUDA graph.
 *
 * A step posts a box: the mailbox row [ready, n, -, -, (src slot, dst slot) x max_pairs] in
 * pinned host memory, written by a kernel (`ferry_signal.post`). The thread spins over the
 * ready words; for each posted box it queues one copy per slot tensor per pair whose
 * destination is not negative (the parts of the box's plan: bank base and slot stride -> cache
 * base and slot stride, bytes), the experts dealt round-robin over the box's lanes (streams:
 * a copy engine runs one stream's copies one after another, each paying the link's read
 * latency, so experts in flight on several lanes overlap it), then joins the lanes into the
 * first (an event each) and copies the word 1 into the box's done word on the device, which
 * the step's `ferry_signal.wait` kernel spins on. The driver's calls come as function pointers
 * (cuMemcpyHtoDAsync and friends on CUDA; on the CPU, where tests run the same protocol,
 * memcpy and no-ops).
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
typedef int (*event_create_fn)(void **event, unsigned flags);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*stream_wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*event_destroy_fn)(void *event);

typedef struct {  /* the driver's calls the thread makes */
    copy_fn copy;
    ctx_fn set_ctx;
    event_create_fn event_create;
    event_record_fn event_record;
    stream_wait_fn stream_wait;
    event_destroy_fn event_destroy;
} Driver;

enum { MAX_LANES = 8, EVENT_DISABLE_TIMING = 2 };

enum { HEADER = 4 };  /* words before a box's pairs: ready, n, two unused */

typedef struct {
    uint64_t src, src_stride, dst, dst_stride, bytes;
} Part;

typedef struct {
    Part *parts;
    int n_parts, src_slots, dst_slots, n_lanes;
    void *lanes[MAX_LANES];
    void *joins[MAX_LANES];  /* lane k > 0: its event, which lane 0 waits for before the done word */
    uint64_t done;           /* device address of the box's done word */
} Plan;

typedef struct {
    volatile int32_t *boxes;
    int n_boxes, max_pairs;
    Plan *plans;
    const int32_t *one;
    Driver drv;
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

int ferry_no_event_create(void **event, unsigned flags) {
    (void)flags;
    *event = NULL;
    return 0;
}

int ferry_no_event_record(void *event, void *stream) {
    (void)event, (void)stream;
    return 0;
}

int ferry_no_stream_wait(void *stream, void *event, unsigned flags) {
    (void)stream, (void)event, (void)flags;
    return 0;
}

int ferry_no_event_destroy(void *event) {
    (void)event;
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
    int moved = 0;
    for (int i = 0; i < n; i++) {
        int32_t src = box[HEADER + 2 * i], dst = box[HEADER + 2 * i + 1];
        if (dst < 0) continue;
        if (src < 0 || src >= p->src_slots || dst >= p->dst_slots) {
            fail(f, -2000 - b);
            continue;
        }
        void *lane = p->lanes[moved % p->n_lanes];
        for (int k = 0; k < p->n_parts; k++) {
            Part *q = &p->parts[k];
            int rc = f->drv.copy(q->dst + (uint64_t)dst * q->dst_stride,
                                 (const void *)(uintptr_t)(q->src + (uint64_t)src * q->src_stride), q->bytes, lane);
            if (rc) fail(f, rc);
            f->bytes += (int64_t)q->bytes;
        }
        moved++;
    }
    f->moved += moved;
    for (int k = 1; k < p->n_lanes && k < moved; k++) {  /* lanes that copied, joined into lane 0 */
        int rc = f->drv.event_record(p->joins[k], p->lanes[k]);
        if (!rc) rc = f->drv.stream_wait(p->lanes[0], p->joins[k], 0);
        if (rc) fail(f, rc);
    }
    int rc = p->done ? f->drv.copy(p->done, f->one, sizeof(int32_t), p->lanes[0]) : -3000 - b;
    if (rc) fail(f, rc);
    f->posts++;
}

static void *run(void *arg) {
    Ferry *f = arg;
    if (f->drv.set_ctx(f->ctx)) fail(f, -1);
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

/* `drv`: six function pointers, in Driver's order. */
Ferry *ferry_new(int32_t *boxes, int n_boxes, int max_pairs, const int32_t *one, void *const *drv, void *ctx,
                 int64_t idle_ns) {
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
    f->drv.copy = (copy_fn)drv[0];
    f->drv.set_ctx = (ctx_fn)drv[1];
    f->drv.event_create = (event_create_fn)drv[2];
    f->drv.event_record = (event_record_fn)drv[3];
    f->drv.stream_wait = (stream_wait_fn)drv[4];
    f->drv.event_destroy = (event_destroy_fn)drv[5];
    f->ctx = ctx;
    f->idle_ns = idle_ns;
    pthread_mutex_init(&f->lock, NULL);
    return f;
}

/* Box `b`'s plan: `n_parts` parts of five words each (src, src_stride, dst, dst_stride, bytes),
 * copied on `n_lanes` streams (the first also carries the done word). Called with the context
 * current (its events are made here, once per box). */
int ferry_plan(Ferry *f, int b, int n_parts, const uint64_t *parts, int src_slots, int dst_slots, int n_lanes,
               void *const *lanes, uint64_t done) {
    if (b < 0 || b >= f->n_boxes || n_lanes < 1 || n_lanes > MAX_LANES) return -1;
    Part *copy = malloc((size_t)(n_parts ? n_parts : 1) * sizeof(Part));
    if (!copy) return -2;
    memcpy(copy, parts, (size_t)n_parts * sizeof(Part));
    pthread_mutex_lock(&f->lock);
    Plan *p = &f->plans[b];
    int rc = 0;
    for (int k = 1; k < n_lanes && !rc; k++)
        if (!p->joins[k]) rc = f->drv.event_create(&p->joins[k], EVENT_DISABLE_TIMING);
    free(p->parts);
    p->parts = copy;
    p->n_parts = n_parts;
    p->src_slots = src_slots;
    p->dst_slots = dst_slots;
    p->n_lanes = n_lanes;
    memcpy(p->lanes, lanes, (size_t)n_lanes * sizeof(void *));
    p->done = done;
    pthread_mutex_unlock(&f->lock);
    return rc ? -3 : 0;
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
    for (int b = 0; b < f->n_boxes; b++) {
        free(f->plans[b].parts);
        for (int k = 1; k < MAX_LANES; k++)
            if (f->plans[b].joins[k]) f->drv.event_destroy(f->plans[b].joins[k]);
    }
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
