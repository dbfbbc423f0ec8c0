/* AutoAWQ's qweight in the device form of int4 weights, on the host while loading.
 *
 * qweight: int32 [in, words] (words = out / 8), input row first; nibble i of word c holds output
 * column 8c + ORDER[i], ORDER = 0 2 4 6 1 3 5 7, so column 8c + col lives in nibble REVERSE[col].
 * out: uint8 [out, in / 2], byte j of row o = input 2j's nibble (low) | input 2j+1's (high).
 * Work goes by tiles of 16 word columns (128 output rows) by 64 input pairs: for each pair (2j,
 * 2j+1) of a word column two word operations merge its 8 bytes at once (nibbles 0 2 4 6 of both
 * words: columns 0 4 1 5; nibbles 1 3 5 7: columns 2 6 3 7), which go to byte j of the word's 8
 * rows in a contiguous tile, then each tile row (64 bytes) is copied out: output rows lie a
 * multiple of 1 KB apart for the usual widths, and written in place they would evict each other
 * from the cache's few sets. One thread: the loader's reader threads run several modules at once
 * (ctypes releases the GIL for the call). moeferry/checkpoint/formats/int4.py builds it with the
 * system C compiler on first use; its PyTorch form (`awq_nibble_bytes`) gives the same bytes and
 * runs without a compiler.
 */
#include <stdint.h>
#include <string.h>

#define WORDS 16 /* word columns a tile: one cache line of an input row */
#define PAIRS 64 /* input pairs a tile: one cache line of an output row */

void awq_repack(const uint32_t *q, int64_t in, int64_t words, uint8_t *out) {
    static const int ROW_OF_BYTE[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* even's bytes, then odd's */
    uint8_t tile[8 * WORDS][PAIRS];
    int64_t half = in / 2;
    for (int64_t c0 = 0; c0 < words; c0 += WORDS) {
        int64_t n = words - c0 < WORDS ? words - c0 : WORDS;
        for (int64_t j0 = 0; j0 < half; j0 += PAIRS) {
            int64_t m = half - j0 < PAIRS ? half - j0 : PAIRS;
            for (int64_t jj = 0; jj < m; jj++) {
                const uint32_t *lo_row = q + 2 * (j0 + jj) * words + c0, *hi_row = lo_row + words;
                for (int64_t b = 0; b < n; b++) {
                    uint32_t lo = lo_row[b], hi = hi_row[b];
                    uint32_t even = (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
                    uint32_t odd = ((lo >> 4) & 0x0F0F0F0Fu) | (((hi >> 4) & 0x0F0F0F0Fu) << 4);
                    for (int k = 0; k < 4; k++) {
                        tile[8 * b + ROW_OF_BYTE[k]][jj] = (uint8_t)(even >> (8 * k));
                        tile[8 * b + ROW_OF_BYTE[4 + k]][jj] = (uint8_t)(odd >> (8 * k));
                    }
                }
            }
            for (int64_t r = 0; r < 8 * n; r++)
                memcpy(out + (8 * c0 + r) * half + j0, tile[r], (size_t)m);
        }
    }
}
