/* Decode attention over RowContexts, one query position per row, and the stores of a step's new
 * keys and values, as torch operators (torch.ops.intone.row_attention, row_store):
 * engine/kernels/row_attention.py compiles this file against the installed torch's headers and
 * loads it with torch.ops.load_library, as decoder_ops.cpp is.
 *
 * Why a kernel: torch runs this step as two batched matrix-vector products per layer (one per
 * row and head: 256 of them at 16 rows, 16 heads), a softmax over padded scores and a bias add.
 * At 16 rows and 150 positions that read the contexts at a third of the memory bandwidth, and it
 * was 42% of a full-size AR step. Here each (row, KV head) streams its keys once and its values
 * once, up to the row's own length (no padding, no mask), and the query heads of a group share
 * those reads.
 *
 * The operators check every bound they rely on, so a wrong argument is a Python error, not a
 * read or write past a tensor. Called from Python, they run without the GIL (torch releases it
 * around an operator), so the decoder thread's Python keeps running meanwhile.
 *
 * Built without -ffast-math: the `omp simd` pragmas are what allow the reductions to vectorise;
 * the softmax's exp is vector_math.h's.
 *
 * The contexts may be float16 (the CPU fast path's, engine/precision.py): the step reads every
 * row's whole context in every layer at the speed of memory, so half the bytes is most of half
 * the time. Queries, scores and sums stay float32; keys and values are widened a vector at a time
 * by the conversion instructions (GCC 12 converts a _Float16 vector lane by lane).
 */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using intone::exp_nonpositive;
using intone::floats;
using intone::LANES;
using intone::load_first;
using intone::load_floats;
using intone::prefetch;
using intone::store_first;
using intone::store_floats;
using intone::sum_lanes;

/* scores[t] <- e^(scores[t] - top) for t < n (every score <= top); returns their sum. */
float exp_shifted(float* scores, int64_t n, float top) {
  floats sums = {};
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    const floats s = exp_nonpositive(load_floats(scores + t) - top);
    store_floats(scores + t, s);
    sums += s;
  }
  float total = 0.0f;
  if (t < n) {
    const floats s = exp_nonpositive(load_first(scores + t, n - t) - top);
    store_first(scores + t, s, n - t);
    for (int64_t i = 0; i < n - t; i++) total += s[i];  /* its other lanes are e^-top */
  }
  for (int64_t i = 0; i < LANES; i++) total += sums[i];
  return total;
}

/* float16, the same IEEE binary16 as torch's at::Half. */
using half = _Float16;

/* LANES float16 values at p as floats, and back (round to nearest even, as torch converts). */
inline floats widen(const half* p) {
#if defined(__AVX512F__)
  return (floats)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (floats)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  floats f;
  for (int64_t i = 0; i < LANES; i++) f[i] = (float)p[i];
  return f;
#endif
}

inline void narrow(floats f, half* p) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph((__m512)f, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && defined(__AVX__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int64_t i = 0; i < LANES; i++) p[i] = (half)f[i];
#endif
}

/* Vectors of a head of up to this many: 256 dims on AVX-512, 128 on AVX, 64 elsewhere. */
constexpr int64_t HEAD_VECTORS = 16;

/* An AR step reads every row's context in every layer, tens of MB, from memory rather than cache,
 * in runs of a few KB per (row, KV head) that the hardware prefetcher picks up late. So while a
 * head's keys are scored, the keys PREFETCH_KEYS positions on and the values at the same position
 * are asked for: full size, 6 layers of 16 rows x 150 positions in float16, 3.6-5.4 ms against
 * 7.2-8.5 (Xeon, one core). */
constexpr int64_t PREFETCH_KEYS = 8;

/* attend_head over float16 keys and values [length, dim], for dim a multiple of LANES of at
 * most HEAD_VECTORS vectors: a key's dot product and a value's sum a vector at a time. */
void attend_head_half(const float* __restrict__ q, const half* __restrict__ k,
                      const half* __restrict__ v, float* __restrict__ out, int64_t group,
                      int64_t dim, int64_t length, float scale, float* __restrict__ scores) {
  const int64_t vectors = dim / LANES;
  for (int64_t j = 0; j < group; j++) {
    floats qv[HEAD_VECTORS];
    for (int64_t c = 0; c < vectors; c++)
      qv[c] = load_floats(q + j * dim + c * LANES);
    float top = -3.4e38f;
    for (int64_t t = 0; t < length; t++) {
      const half* kt = k + t * dim;
      if (j == 0) {  /* within the row's keys: nothing is asked for past them */
        if (t + PREFETCH_KEYS < length) prefetch(kt + PREFETCH_KEYS * dim, dim * sizeof(half));
        prefetch(v + t * dim, dim * sizeof(half));
      }
      floats acc = {};
      for (int64_t c = 0; c < vectors; c++) acc += qv[c] * widen(kt + c * LANES);
      scores[t] = sum_lanes(acc) * scale;
      top = scores[t] > top ? scores[t] : top;
    }
    const float total = exp_shifted(scores, length, top);
    floats acc[HEAD_VECTORS] = {};
    for (int64_t t = 0; t < length; t++) {
      const half* vt = v + t * dim;
      const float p = scores[t];
      for (int64_t c = 0; c < vectors; c++) acc[c] += p * widen(vt + c * LANES);
    }
    const float inverse = 1.0f / total;
    for (int64_t c = 0; c < vectors; c++) store_floats(out + j * dim + c * LANES, acc[c] * inverse);
  }
}

/* The `group` query heads q [group, dim] of one KV head over its `length` keys and values
 * [length, dim]; out [group, dim]; scores: room for `length` floats, acc for `dim`. Dim: the
 * head size where it is known at compile time (0: `dim`). */
template <int64_t Dim>
void attend_head(const float* __restrict__ q, const float* __restrict__ k,
                 const float* __restrict__ v, float* __restrict__ out, int64_t group,
                 int64_t runtime_dim, int64_t length, float scale, float* __restrict__ scores,
                 float* __restrict__ scratch) {
  const int64_t dim = Dim > 0 ? Dim : runtime_dim;
  /* A constant size lets the compiler keep a query and its accumulator in registers. */
  float fixed[Dim > 0 ? Dim : 1];
  float* __restrict__ acc = Dim > 0 ? fixed : scratch;
  for (int64_t j = 0; j < group; j++) {
    const float* __restrict__ qj = q + j * dim;
    float top = -3.4e38f;
    for (int64_t t = 0; t < length; t++) {
      const float* __restrict__ kt = k + t * dim;
      if (j == 0) {  /* within the row's keys: nothing is asked for past them */
        if (t + PREFETCH_KEYS < length) prefetch(kt + PREFETCH_KEYS * dim, dim * sizeof(float));
        prefetch(v + t * dim, dim * sizeof(float));
      }
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; d++) s += qj[d] * kt[d];
      scores[t] = s * scale;
      top = scores[t] > top ? scores[t] : top;
    }
    const float total = exp_shifted(scores, length, top);
    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < length; t++) {
      const float* __restrict__ vt = v + t * dim;
      const float p = scores[t];
#pragma omp simd
      for (int64_t d = 0; d < dim; d++) acc[d] += p * vt[d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; d++) out[j * dim + d] = acc[d] * inverse;
  }
}

void check_row_vector(const at::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 &&
                        t.size(0) == rows && t.is_contiguous(),
                    name, " must be contiguous int64 [", rows, "] on the CPU, not ",
                    t.scalar_type(), " ", t.sizes());
}

/* q [rows, heads, D]; one layer's row contexts, keys and values [contexts >= rows, kv_heads,
 * capacity, D], float32 or float16 on the CPU, row r in context r, positions D values apart;
 * lengths [rows] (int64): the positions row r reads (1 .. capacity). Query head i reads KV head
 * i / (heads / kv_heads). Returns [rows, heads, D] in float32. */
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& lengths) {
  const bool halves = keys.scalar_type() == at::kHalf;
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat &&
                       (keys.scalar_type() == at::kFloat || halves) &&
                       values.scalar_type() == keys.scalar_type(),
                   "row_attention takes float32 queries over float32 or float16 contexts, not ",
                   q.scalar_type(), "/", keys.scalar_type(), "/", values.scalar_type());
  TORCH_CHECK_VALUE(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
                    "row_attention runs on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes(),
                    "q [rows, heads, D] and keys, values [contexts, kv_heads, capacity, D], not ",
                    q.sizes(), keys.sizes(), values.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2);
  TORCH_CHECK_VALUE(keys.strides() == values.strides() && keys.size(3) == dim &&
                        keys.stride(2) == dim && keys.stride(3) == 1,
                    "row_attention needs keys and values laid out as RowContexts keeps them");
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0 && rows <= keys.size(0), rows,
                    " rows of ", heads, " heads over contexts ", keys.sizes());
  check_row_vector(lengths, rows, "lengths");
  const int64_t* length = lengths.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t r = 0; r < rows; r++) {
    /* Trusted below: checked here, where a wrong one is an error, not a read past the contexts. */
    TORCH_CHECK_VALUE(length[r] >= 1 && length[r] <= capacity, "lengths must lie in 1 .. ",
                      capacity, ", not ", lengths);
    longest = length[r] > longest ? length[r] : longest;
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({rows, heads, dim}, qc.options());
  std::vector<float> scratch(longest + dim);
  TORCH_CHECK_VALUE(!halves || (dim % LANES == 0 && dim <= HEAD_VECTORS * LANES),
                    "float16 contexts need a head size that is a multiple of ", LANES,
                    " up to ", HEAD_VECTORS * LANES, ", not ", dim);
  const float* qs = qc.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const int64_t context_stride = keys.stride(0), head_stride = keys.stride(1);
  const float scale = (float)(1.0 / std::sqrt((double)dim));
  float* scores = scratch.data();
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t h = 0; h < kv_heads; h++) {
      const int64_t first = (r * heads + h * group) * dim;
      const int64_t context = r * context_stride + h * head_stride;
      if (halves) {
        const half* ks = reinterpret_cast<const half*>(keys.data_ptr<at::Half>());
        const half* vs = reinterpret_cast<const half*>(values.data_ptr<at::Half>());
        attend_head_half(qs + first, ks + context, vs + context, os + first, group, dim,
                         length[r], scale, scores);
        continue;
      }
      const float* ks = keys.data_ptr<float>();
      const float* vs = values.data_ptr<float>();
      /* 64: every released config's head size. */
      if (dim == 64)
        attend_head<64>(qs + first, ks + context, vs + context, os + first, group, dim, length[r],
                        scale, scores, scores + longest);
      else
        attend_head<0>(qs + first, ks + context, vs + context, os + first, group, dim, length[r],
                       scale, scores, scores + longest);
    }
  }
  return out;
}

/* target + offsets[r] + h * target.stride(-3) <- source[r, h, :] (D floats) for every row r and
 * head h: a step's new keys or values into the pool's slots of a layer ([heads, slots, D],
 * offsets: slot * D) or the row contexts ([contexts, heads, capacity, D], float32 or float16).
 * torch's index_copy_ and index_put_ took 80 us a call for these 256 runs of 256 bytes (full
 * size, 16 rows). */
void row_store(const at::Tensor& source, const at::Tensor& target, const at::Tensor& offsets) {
  const bool halves = target.scalar_type() == at::kHalf;
  TORCH_CHECK_TYPE(source.scalar_type() == at::kFloat &&
                       (target.scalar_type() == at::kFloat || halves),
                   "row_store takes float32 into float32 or float16, not ", source.scalar_type(),
                   "/", target.scalar_type());
  TORCH_CHECK_VALUE(source.device().is_cpu() && target.device().is_cpu(),
                    "row_store runs on the CPU");
  TORCH_CHECK_VALUE(source.dim() == 3 && target.dim() >= 3, "source [rows, heads, D], not ",
                    source.sizes(), " into ", target.sizes());
  const int64_t rows = source.size(0), heads = source.size(1), dim = source.size(2);
  TORCH_CHECK_VALUE(target.size(-3) == heads && target.size(-1) == dim && target.stride(-1) == 1,
                    source.sizes(), " does not fit ", target.sizes());
  check_row_vector(offsets, rows, "offsets");
  const int64_t head_stride = target.stride(-3);
  int64_t extent = 1; /* the elements the target spans */
  for (int64_t i = 0; i < target.dim(); i++) {
    TORCH_CHECK_VALUE(target.stride(i) >= 0, "row_store needs non-negative strides");
    extent += (target.size(i) - 1) * target.stride(i);
  }
  const int64_t* offset = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; r++)
    TORCH_CHECK_VALUE(offset[r] >= 0 && offset[r] + (heads - 1) * head_stride + dim <= extent,
                      "offsets ", offsets, " fall outside ", target.sizes());
  const at::Tensor src = source.contiguous();
  const float* from = src.data_ptr<float>();
  if (halves) {
    half* to = reinterpret_cast<half*>(target.data_ptr<at::Half>());
    for (int64_t r = 0; r < rows; r++)
      for (int64_t h = 0; h < heads; h++) {
        const float* run = from + (r * heads + h) * dim;
        half* into = to + offset[r] + h * head_stride;
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES) narrow(load_floats(run + d), into + d);
        for (; d < dim; d++) into[d] = (half)run[d];
      }
    return;
  }
  float* to = target.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++)
      std::memcpy(to + offset[r] + h * head_stride, from + (r * heads + h) * dim,
                  sizeof(float) * dim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intone, m) {
  m.def("row_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths) -> Tensor",
        &row_attention);
  m.def("row_store(Tensor source, Tensor(a!) target, Tensor offsets) -> ()", &row_store);
}
