/* Many byte copies in one call: the templated placement of a layer's experts (about 2300
 * copies from the memory-mapped checkpoint into a host slot buffer) without Python between
 * them. moeferry/memory/spans.py builds it with the system C compiler on first use and calls it
 * through ctypes, which releases the GIL for the call.
 *
 * moves: n rows of (destination address, source address, bytes); the ranges do not overlap.
 * The rows are shared out among `threads` OpenMP threads a few at a time (their sizes differ).
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
