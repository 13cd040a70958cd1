/* The CPU decoder's elementwise passes and its transformer's ring attention as torch operators:
 * engine/kernels/decoder_ops.py compiles this file against the installed torch's headers and
 * loads it with torch.ops.load_library.
 *
 * Why operators (as every native kernel here is): the decoder's two parts run as TorchScript
 * traces (traces.py), which the tracer records as a list of registered operators and replays
 * without the GIL. A foreign call (ctypes) would be left out of a trace; a
 * registered operator is recorded like aten's own.
 *
 * What each saves, per 16-row x 1-frame decode call of the full-size decoder on one core:
 * - elu_into: aten's ELU (or the five torch passes cpu_decoder.py used) reads and
 *   writes each of ~8.5 million elements five times; here once.
 * - gelu_tanh: aten's tanh-approximated GELU spends its time in a vectorised tanh; 1/(1 + e^-2z)
 *   is the same function at a third of the cost.
 * - ring_attention: SDPA over the whole ring (313 slots for 250 keys a query may see) with a
 *   boolean mask built per call; here each row's queries read only the slots they may see, in
 *   place (the pool's rows by index, where given), with no mask tensor.
 *
 * Built without -ffast-math: every loop works on GCC vector types (`floats`, vector_math.h), so
 * nothing relies on the compiler vectorising a scalar loop.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

using intone::exp_nonpositive;
using intone::floats;
using intone::ints;
using intone::map_floats;
using intone::prefetch;

/* Queries per block: the lanes of one vector. */
constexpr int64_t QB = intone::LANES;
/* Keys per pass of the score loop: independent accumulators. */
constexpr int64_t KB = 8;
/* Value dims per pass of the output loop: accumulators in registers. */
constexpr int64_t DB = 16;
/* A row's ring is read a head at a time: for each slot, one head's D floats, then the next
 * slot's, a ring-row (all heads) further on; strides the hardware prefetcher does not pick up.
 * So the keys and values this many slots on are asked for while a slot's are used. Full-size
 * decoder (8 rows x 32 queries x 8 heads, 313 slots), one Xeon core, the ring out of cache as it
 * is between a call's layers: 2.7 ms a layer against 4.5 (in cache 1.9 against 2.2); the 2M
 * decoder's (25 rows x 16 x 4 heads of 32): 0.81 against 1.01. */
constexpr int64_t PREFETCH_SLOTS = 16;

/* Whether a [B, T, C] tensor's rows (its last two dims) are contiguous: the decoder's
 * activations are such views of wider buffers (a convolution's history in front). */
bool dense_rows(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2));
}

at::Tensor& elu_into(const at::Tensor& input, at::Tensor& out) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "elu_into takes float32, not ", input.scalar_type(), " into ", out.scalar_type());
  TORCH_CHECK(input.dim() == 3, "x must be [B, T, C], not ", input.sizes());
  TORCH_CHECK(input.sizes() == out.sizes(), "out ", out.sizes(), " must match x ", input.sizes());
  TORCH_CHECK(dense_rows(out), "out must have contiguous [T, C] rows, strides ", out.strides());
  const at::Tensor x = dense_rows(input) ? input : input.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) * x.size(2);
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t x_step = x.stride(0), out_step = out.stride(0);
  /* e^x - 1 for x <= 0 is within 1e-7 of expm1 (the reference's ELU). */
  const auto elu = [](floats v) {
    const floats e = exp_nonpositive(v < 0.0f ? v : floats{}) - 1.0f;
    return v > 0.0f ? v : e;
  };
  for (int64_t b = 0; b < rows; b++) map_floats(xs + b * x_step, os + b * out_step, n, elu);
  return out;
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, not ", x.scalar_type());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options());
  /* x (1 + tanh z) / 2 = x / (1 + e^-2z), z = k (x + 0.044715 x^3); e^-2z through |z| so that
   * the exponent stays <= 0: for z < 0, x e^2z / (1 + e^2z). */
  const auto gelu = [](floats v) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    const floats z = k * (v + 0.044715f * v * v * v);
    const floats e = exp_nonpositive(-2.0f * (z < 0.0f ? -z : z));
    return v * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
  };
  map_floats(in.data_ptr<float>(), out.data_ptr<float>(), in.numel(), gelu);
  return out;
}

/* One (row, query head, block of up to QB queries) over `count` slots: scores, softmax and the
 * weighted values, written to out [nq queries, dim] (rows out_stride apart).
 * qt: [dim] vectors of the block's queries, scaled. q_pos, key_pos: relative to the block's
 * first query, so that they fit int32 lanes. scores: room for `count` vectors. */
void attend_block(const floats* qt, const float* keys, const float* values, int64_t slot_stride,
                  const int64_t* slots, const int32_t* key_pos, int64_t count, ints q_pos,
                  int32_t context, int64_t dim, floats* scores, float* out, int64_t out_stride,
                  int64_t nq) {
  const floats minus_inf = floats{} - std::numeric_limits<float>::infinity();
  floats top = minus_inf;
  for (int64_t j0 = 0; j0 < count; j0 += KB) {
    const int64_t nk = count - j0 < KB ? count - j0 : KB;
    floats acc[KB] = {};
    const float* k[KB];
    for (int64_t c = 0; c < KB; c++) k[c] = keys + slots[j0 + (c < nk ? c : 0)] * slot_stride;
    for (int64_t c = j0 + PREFETCH_SLOTS; c < j0 + PREFETCH_SLOTS + KB && c < count; c++)
      prefetch(keys + slots[c] * slot_stride, dim * sizeof(float));
    for (int64_t d = 0; d < dim; d++) {
      const floats qd = qt[d];
      for (int64_t c = 0; c < KB; c++) acc[c] += k[c][d] * qd;
    }
    for (int64_t c = 0; c < nk; c++) {
      const ints delta = q_pos - key_pos[j0 + c];
      const floats s = (delta >= 0) & (delta < context) ? acc[c] : minus_inf;
      top = s > top ? s : top;
      scores[j0 + c] = s;
    }
  }
  floats total = {};
  for (int64_t j = 0; j < count; j++) {
    const floats s = scores[j];
    const floats e = s == minus_inf ? floats{} : exp_nonpositive(s - top);
    scores[j] = e;
    total += e;
  }
  for (int64_t d0 = 0; d0 < dim; d0 += DB) {
    const int64_t nd = dim - d0 < DB ? dim - d0 : DB;
    floats acc[DB] = {};
    if (nd == DB) {
      for (int64_t j = 0; j < count; j++) {
        const float* v = values + slots[j] * slot_stride + d0;
        /* The first pass over the dims is the first to reach each slot. */
        if (d0 == 0 && j + PREFETCH_SLOTS < count)
          prefetch(values + slots[j + PREFETCH_SLOTS] * slot_stride, dim * sizeof(float));
        const floats p = scores[j];
        for (int64_t dd = 0; dd < DB; dd++) acc[dd] += v[dd] * p;
      }
    } else {
      for (int64_t j = 0; j < count; j++) {
        const float* v = values + slots[j] * slot_stride + d0;
        for (int64_t dd = 0; dd < nd; dd++) acc[dd] += v[dd] * scores[j];
      }
    }
    for (int64_t dd = 0; dd < nd; dd++) {
      const floats o = acc[dd] / total;
      for (int64_t i = 0; i < nq; i++) out[i * out_stride + d0 + dd] = o[i];
    }
  }
}

/* Attention of queries q [B, T, H, D] at `positions` [B, T] over a ring of keys and values
 * [P, S, Hkv, D] whose slots hold positions key_positions [P, S] (-1: empty): a query at p sees
 * the keys at 0 <= p - position < context. Row b reads pool row rows[b] where `rows` is given,
 * else row b. Returns [B, T, H, D]. */
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& key_positions, const at::Tensor& positions,
                          const std::optional<at::Tensor>& rows, int64_t context) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "ring_attention takes float32 queries, keys and values");
  TORCH_CHECK(key_positions.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "ring_attention takes int64 positions");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes(),
              "q [B, T, H, D] and keys, values [P, S, Hkv, D]: ", q.sizes(), keys.sizes(),
              values.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t P = keys.size(0), S = keys.size(1), Hkv = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && Hkv > 0 && H % Hkv == 0, "heads or dims do not match: ",
              q.sizes(), keys.sizes());
  TORCH_CHECK(keys.strides() == values.strides() && keys.stride(3) == 1 &&
                  keys.stride(2) == D && keys.stride(1) == Hkv * D,
              "keys and values must share strides with contiguous slots");
  TORCH_CHECK(key_positions.sizes() == at::IntArrayRef({P, S}) && key_positions.stride(1) == 1,
              "key_positions must be [P, S] with contiguous rows");
  TORCH_CHECK(positions.sizes() == at::IntArrayRef({B, T}), "positions must be [B, T]");
  TORCH_CHECK(context > 0 && context < (int64_t(1) << 30), "context out of range: ", context);
  const at::Tensor qc = q.contiguous(), pos = positions.contiguous();
  std::vector<int64_t> row_of(B);
  if (rows.has_value()) {
    const at::Tensor r = rows->contiguous();
    TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 1 && r.size(0) == B,
                "rows must be int64 [B]");
    for (int64_t b = 0; b < B; b++) {
      row_of[b] = r.data_ptr<int64_t>()[b];
      TORCH_CHECK(row_of[b] >= 0 && row_of[b] < P, "row ", row_of[b], " outside the pool of ", P);
    }
  } else {
    TORCH_CHECK(P == B, "without rows, keys must have B rows");
    for (int64_t b = 0; b < B; b++) row_of[b] = b;
  }
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const float* qs = qc.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* ks = keys.data_ptr<float>();
  const float* vs = values.data_ptr<float>();
  const int64_t* kps = key_positions.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  const float scale = 1.0f / std::sqrt((float)D);
  const int64_t blocks = (T + QB - 1) / QB;
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(S);
    std::vector<int32_t> slot_pos(S);
    std::vector<floats> scores(S), qt(D);
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / blocks, q0 = (task % blocks) * QB;
      const int64_t nq = T - q0 < QB ? T - q0 : QB;
      const int64_t row = row_of[b];
      const int64_t* block_pos = ps + b * T + q0;
      int64_t lo = block_pos[0], hi = block_pos[0];
      for (int64_t i = 0; i < nq; i++)
        lo = block_pos[i] < lo ? block_pos[i] : lo, hi = block_pos[i] > hi ? block_pos[i] : hi;
      TORCH_CHECK(hi - lo < (int64_t(1) << 30), "query positions of one row too far apart");
      ints q_pos = {};
      for (int64_t i = 0; i < QB; i++) q_pos[i] = (int32_t)(block_pos[i < nq ? i : 0] - lo);
      /* The slots any query of the block may see. */
      int64_t count = 0;
      const int64_t* row_pos = kps + row * key_positions.stride(0);
      for (int64_t s = 0; s < S; s++) {
        const int64_t kp = row_pos[s];
        if (kp >= 0 && kp <= hi && hi - kp < context + (hi - lo)) {
          slots[count] = s;
          slot_pos[count++] = (int32_t)(kp - lo);
        }
      }
      for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / (H / Hkv);
        for (int64_t d = 0; d < D; d++)
          for (int64_t i = 0; i < QB; i++)
            qt[d][i] = i < nq ? qs[((b * T + q0 + i) * H + h) * D + d] * scale : 0.0f;
        const float* krow = ks + row * keys.stride(0) + g * D;
        const float* vrow = vs + row * values.stride(0) + g * D;
        attend_block(qt.data(), krow, vrow, Hkv * D, slots.data(), slot_pos.data(), count, q_pos,
                     (int32_t)context, D, scores.data(), os + ((b * T + q0) * H + h) * D, H * D,
                     nq);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intone, m) {
  m.def("elu_into(Tensor x, Tensor(a!) out) -> Tensor(a!)", &elu_into);
  m.def("gelu_tanh(Tensor x) -> Tensor", &gelu_tanh);
  m.def(
      "ring_attention(Tensor q, Tensor keys, Tensor values, Tensor key_positions, "
      "Tensor positions, Tensor? rows, int context) -> Tensor",
      &ring_attention);
}
