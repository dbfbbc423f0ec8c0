/* Many byte copies in one call: the templated placement of a layer's experts (about 2300
 * copies from the memory-mapped checkpoint into a host slot buffer) without Python between
 * them. moeferry/memory/spans.py builds it with the system C compiler on first use and calls it
 * through ctypes, which releases the GIL for the call.
 *
 * moves: n rows of (destination address, source address, bytes); the ranges do not overlap.
 * The rows are shared out among `threads` OpenMP threads a few at a time (their sizes differ).
 * fills: n rows of (destination address, source address, element bytes, count): the element
 * at the source written `count` times from the destination on (a per-tensor scale broadcast over
 * a slot's rows; 768 of them a NVFP4 layer).
 */
#include <stdint.h>
#include <string.h>

void copy_spans(int64_t n, const int64_t *moves, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads > 0 ? threads : 1)
#else
    (void)threads;
#endif
    for (int64_t i = 0; i < n; i++)
        memcpy((void *)(intptr_t)moves[3 * i], (const void *)(intptr_t)moves[3 * i + 1], (size_t)moves[3 * i + 2]);
}

static void fill_one(char *dst, const char *src, int64_t size, int64_t count) {
    if (size == 4) {  /* (the common case: a float scale; a loop the compiler vectorizes) */
        uint32_t v;
        memcpy(&v, src, 4);
        uint32_t *d = (uint32_t *)dst;
        for (int64_t k = 0; k < count; k++)
            memcpy(d + k, &v, 4);
        return;
    }
    for (int64_t k = 0; k < count; k++)
        memcpy(dst + k * size, src, (size_t)size);
}

void fill_spans(int64_t n, const int64_t *fills, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads > 0 ? threads : 1)
#else
    (void)threads;
#endif
    for (int64_t i = 0; i < n; i++)
        fill_one((char *)(intptr_t)fills[4 * i], (const char *)(intptr_t)fills[4 * i + 1], fills[4 * i + 2],
                 fills[4 * i + 3]);
}
