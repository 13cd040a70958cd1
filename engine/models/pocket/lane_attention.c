/* Decode attention over KVLanes, one query position per row, and the stores of a step's new keys
 * and values: engine/models/pocket/lane_kernel.py compiles this file with the machine's C
 * compiler and calls it through ctypes.
 *
 * Why a kernel: torch runs this step as two batched matrix-vector products per layer (one per
 * row and head: 256 of them at 16 rows, 16 heads), a softmax over padded scores and a bias add.
 * At 16 rows and 150 positions that read the lanes at a third of the memory bandwidth, and it
 * was 42% of a full-size AR step (bench/results/cpu-2core-stages/README.md). Here each (row, KV
 * head) streams its keys once and its values once, up to the row's own length (no padding, no
 * mask), and the query heads of a group share those reads.
 *
 * Built without -ffast-math: the `omp simd` pragmas are what allow the reductions to vectorise,
 * and exp_nonpositive is written out so the softmax loop vectorises too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (a score minus its row's maximum), within 2 ulp of expf (Cephes' expf
 * polynomial); below -87 it returns 0's neighbour e^-87. */
static inline float exp_nonpositive(float x)
{
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + round) - round;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return p * two_to_n;
}

/* The `group` query heads q [group, dim] of one KV head over its `length` keys and values
 * [length, dim]; out [group, dim]; scores: room for `length` floats. */
static inline void attend_head(
    const float *restrict q, const float *restrict k, const float *restrict v,
    float *restrict out, int64_t group, int64_t dim, int64_t length, float scale,
    float *restrict scores)
{
    for (int64_t j = 0; j < group; j++) {
        const float *restrict qj = q + j * dim;
        float top = -3.4e38f;
        for (int64_t t = 0; t < length; t++) {
            const float *restrict kt = k + t * dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; d++)
                s += qj[d] * kt[d];
            scores[t] = s * scale;
            top = scores[t] > top ? scores[t] : top;
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; t++) {
            float e = exp_nonpositive(scores[t] - top);
            scores[t] = e;
            total += e;
        }
        float acc[dim];
        for (int64_t d = 0; d < dim; d++)
            acc[d] = 0.0f;
        for (int64_t t = 0; t < length; t++) {
            const float *restrict vt = v + t * dim;
            float p = scores[t];
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                acc[d] += p * vt[d];
        }
        float inverse = 1.0f / total;
        for (int64_t d = 0; d < dim; d++)
            out[j * dim + d] = acc[d] * inverse;
    }
}

/* q, out [rows, heads, dim], contiguous. Row r's keys and values for KV head h start at
 * keys/values + r * lane_stride + h * head_stride, one position every `dim` floats, and it
 * reads its first lengths[r] (>= 1) positions. Query head i reads KV head i / (heads / kv_heads).
 * Returns 0, or -1 where it could not allocate its scratch (out is then unwritten). */
int lane_attention(
    const float *q, const float *keys, const float *values, const int64_t *lengths, float *out,
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t lane_stride,
    int64_t head_stride, float scale)
{
    int64_t group = heads / kv_heads, longest = 1;
    for (int64_t r = 0; r < rows; r++)
        longest = lengths[r] > longest ? lengths[r] : longest;
    float *scores = malloc(sizeof(float) * longest);
    if (!scores)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t first = (r * heads + h * group) * dim, offset = r * lane_stride + h * head_stride;
            /* A constant 64 (every released config's head size) lets the compiler keep a
               query and its accumulator in registers. */
            if (dim == 64)
                attend_head(q + first, keys + offset, values + offset, out + first, group, 64,
                            lengths[r], scale, scores);
            else
                attend_head(q + first, keys + offset, values + offset, out + first, group, dim,
                            lengths[r], scale, scores);
        }
    }
    free(scores);
    return 0;
}

/* dst + offsets[r] + h * head_stride <- src[r, h, :] (dim floats) for every row r and head h:
 * a step's new keys or values into the pool's slots or the rows' lanes. torch's index_copy_
 * and index_put_ took 80 us a call for these 256 runs of 256 bytes (full size, 16 rows). */
void store_rows(
    const float *src, float *dst, const int64_t *offsets, int64_t rows, int64_t heads,
    int64_t dim, int64_t head_stride)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            memcpy(dst + offsets[r] + h * head_stride, src + (r * heads + h) * dim,
                   sizeof(float) * dim);
}
