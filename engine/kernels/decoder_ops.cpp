/* The CPU decoder's elementwise passes, its narrow convolutions and its transformer's ring
 * attention as torch operators:
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
 * - causal_conv: a narrow SEANet convolution as K GEMMs of a few dozen columns each, after a
 *   history-prefixed copy, an ELU pass and before a residual add; here one pass per row
 *   (its comment says more).
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

#include <algorithm>
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
using intone::LANES;
using intone::load_first;
using intone::load_floats;
using intone::map_floats;
using intone::prefetch;
using intone::store_first;
using intone::store_floats;
using intone::sum_lanes;

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
  for (int64_t b = 0; b < rows; b++)
    map_floats(xs + b * x_step, os + b * out_step, n, [](floats v) { return intone::elu(v); });
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

/* Output vectors per register block of `causal_conv`: wider layers run in chunks this wide. Its
 * blocks are J steps x V vectors, at most CONV_STEPS steps (where V = 1). */
constexpr int64_t CONV_VECTORS = 4;
constexpr int CONV_STEPS = 16;

/* One row's outputs y [steps, cout], channels [c0, c0 + V * LANES): y[t] = bias + the sum over
 * taps k and input channels ci of buf[t + k * dilation][ci] * w[k][ci], plus residual[t] where
 * given. J steps at a time, their J x V accumulators in registers: each input value is
 * broadcast against V weight vectors. buf rows are `cin` floats, w rows (one per tap and input
 * channel) `wstride`; the last block's extra steps read zero rows past buf's end and are not
 * stored. (The loops over J and V are unrolled so that GCC keeps the accumulators in registers.) */
template <int V, int J>
void conv_row(const float* buf, int64_t steps, int64_t cin, int64_t taps, int64_t dilation,
              const float* w, int64_t wstride, const float* bias, int64_t c0, int64_t cout,
              const float* residual, float* out) {
  floats b[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; v++) b[v] = load_floats(bias + c0 + v * LANES);
  const int64_t width = std::min<int64_t>(V * LANES, cout - c0);
  for (int64_t t0 = 0; t0 < steps; t0 += J) {
    floats acc[J][V];
#pragma GCC unroll 16
    for (int j = 0; j < J; j++)
#pragma GCC unroll 8
      for (int v = 0; v < V; v++) acc[j][v] = b[v];
    for (int64_t k = 0; k < taps; k++) {
      const float* in = buf + (t0 + k * dilation) * cin;
      const float* wk = w + k * cin * wstride + c0;
      for (int64_t ci = 0; ci < cin; ci++) {
        floats wv[V];
#pragma GCC unroll 8
        for (int v = 0; v < V; v++) wv[v] = load_floats(wk + ci * wstride + v * LANES);
#pragma GCC unroll 16
        for (int j = 0; j < J; j++) {
          const float s = in[j * cin + ci];
#pragma GCC unroll 8
          for (int v = 0; v < V; v++) acc[j][v] += s * wv[v];
        }
      }
    }
    const int64_t nj = std::min<int64_t>(J, steps - t0);
#pragma GCC unroll 16
    for (int j = 0; j < J; j++) {
      if (j >= nj) break;
      float* o = out + (t0 + j) * cout + c0;
      const float* r = residual == nullptr ? nullptr : residual + (t0 + j) * cout + c0;
#pragma GCC unroll 8
      for (int v = 0; v < V; v++) {
        const int64_t n = std::min<int64_t>(LANES, width - v * LANES);
        if (n <= 0) break;
        floats y = acc[j][v];
        if (n == LANES) {
          if (r != nullptr) y += load_floats(r + v * LANES);
          store_floats(o + v * LANES, y);
        } else {
          if (r != nullptr) y += load_first(r + v * LANES, n);
          store_first(o + v * LANES, y, n);
        }
      }
    }
  }
}

/* `conv_row` for one output channel, where it would use one lane of LANES: each step's
 * output is the dot product of its K taps' input rows (w [K, cin], contiguous) with the weights. */
void conv_row_single(const float* buf, int64_t steps, int64_t cin, int64_t taps,
                     int64_t dilation, const float* w, float bias, const float* residual,
                     float* out) {
  const int64_t full = cin / LANES * LANES, rest = cin - full;
  for (int64_t t = 0; t < steps; t++) {
    floats acc = {};
    for (int64_t k = 0; k < taps; k++) {
      const float* in = buf + (t + k * dilation) * cin;
      const float* wk = w + k * cin;
      for (int64_t c = 0; c < full; c += LANES) acc += load_floats(in + c) * load_floats(wk + c);
      if (rest) acc += load_first(in + full, rest) * load_first(wk + full, rest);
    }
    out[t] = bias + sum_lanes(acc) + (residual == nullptr ? 0.0f : residual[t]);
  }
}

/* A causal convolution of x [B, T, Cin] with its stored `history` [B, H, Cin], H = (K - 1) x
 * dilation, in front: y [B, T, Cout] = bias + sum_k buf[t + k * dilation] @ weights[k], where
 * buf = history, then x (through the ELU where `elu`); buf's newest H frames become the history
 * (in place). `residual` [B, T, Cout] is added to y where given.
 *
 * Why: the SEANet's narrow layers (24-96 channels at 480-1920 steps a frame) as K GEMMs of a
 * few dozen columns each read the whole activation K times and run at a fraction of a core's
 * FMA rate, after passes that build the history-prefixed copy and the ELU. Here each row's
 * buffer is built once, in cache, and the outputs come from registers. */
at::Tensor causal_conv(const at::Tensor& x, const std::optional<at::Tensor>& history,
                       const at::Tensor& weights, const std::optional<at::Tensor>& bias,
                       int64_t dilation, bool elu, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat,
              "causal_conv takes float32");
  TORCH_CHECK(x.dim() == 3 && weights.dim() == 3 && weights.size(1) == x.size(2),
              "x [B, T, Cin] and weights [K, Cin, Cout]: ", x.sizes(), weights.sizes());
  TORCH_CHECK(dilation >= 1, "dilation must be >= 1, not ", dilation);
  const int64_t B = x.size(0), T = x.size(1), cin = x.size(2);
  const int64_t taps = weights.size(0), cout = weights.size(2), H = (taps - 1) * dilation;
  TORCH_CHECK(taps >= 1 && cout >= 1, "weights must have taps and output channels");
  if (H > 0) {
    TORCH_CHECK(history.has_value() && history->scalar_type() == at::kFloat &&
                    history->sizes() == at::IntArrayRef({B, H, cin}) && dense_rows(*history),
                "history must be float32 [B, ", H, ", ", cin, "] with contiguous rows");
  }
  const at::Tensor xs = dense_rows(x) ? x : x.contiguous();
  /* Weights and bias padded to whole vectors, so that every block reads full ones. */
  const int64_t vectors = (cout + LANES - 1) / LANES, wstride = vectors * LANES;
  std::vector<float> w(taps * cin * wstride, 0.0f), b(wstride, 0.0f);
  const at::Tensor wc = weights.contiguous();
  for (int64_t r = 0; r < taps * cin; r++)
    std::memcpy(w.data() + r * wstride, wc.data_ptr<float>() + r * cout, cout * sizeof(float));
  if (bias.has_value()) {
    const at::Tensor bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == cout, "bias must be [Cout]");
    std::memcpy(b.data(), bc.data_ptr<float>(), cout * sizeof(float));
  }
  at::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == at::IntArrayRef({B, T, cout}) &&
                    residual->scalar_type() == at::kFloat,
                "residual must be float32 [B, T, Cout]");
    res = dense_rows(*residual) ? *residual : residual->contiguous();
  }
  at::Tensor out = at::empty({B, T, cout}, x.options());
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    /* history, then x, then zero rows that a last partial block reads past the end. */
    std::vector<float> buf((H + T + CONV_STEPS) * cin, 0.0f);
    for (int64_t r = begin; r < end; r++) {
      float* hist = H > 0 ? history->data_ptr<float>() + r * history->stride(0) : nullptr;
      if (H > 0) std::memcpy(buf.data(), hist, H * cin * sizeof(float));
      const float* xr = xs.data_ptr<float>() + r * xs.stride(0);
      if (elu) {
        map_floats(xr, buf.data() + H * cin, T * cin, [](floats v) { return intone::elu(v); });
      } else {
        std::memcpy(buf.data() + H * cin, xr, T * cin * sizeof(float));
      }
      if (H > 0) std::memcpy(hist, buf.data() + T * cin, H * cin * sizeof(float));
      const float* rr = residual.has_value() ? res.data_ptr<float>() + r * res.stride(0) : nullptr;
      float* o = out.data_ptr<float>() + r * T * cout;
      if (cout == 1) {
        conv_row_single(buf.data(), T, cin, taps, dilation, wc.data_ptr<float>(), b[0], rr, o);
        continue;
      }
      for (int64_t c0 = 0; c0 < cout; c0 += CONV_VECTORS * LANES) {
        const int64_t left = (cout - c0 + LANES - 1) / LANES;
        switch (left >= CONV_VECTORS ? CONV_VECTORS : left) {
          case 1:
            conv_row<1, CONV_STEPS>(buf.data(), T, cin, taps, dilation, w.data(), wstride,
                                    b.data(), c0, cout, rr, o);
            break;
          case 2:
            conv_row<2, 12>(buf.data(), T, cin, taps, dilation, w.data(), wstride, b.data(), c0,
                            cout, rr, o);
            break;
          case 3:
            conv_row<3, 8>(buf.data(), T, cin, taps, dilation, w.data(), wstride, b.data(), c0,
                           cout, rr, o);
            break;
          default:
            conv_row<4, 6>(buf.data(), T, cin, taps, dilation, w.data(), wstride, b.data(), c0,
                           cout, rr, o);
        }
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
      "causal_conv(Tensor x, Tensor(a!)? history, Tensor weights, Tensor? bias, int dilation, "
      "bool elu, Tensor? residual) -> Tensor",
      &causal_conv);
  m.def(
      "ring_attention(Tensor q, Tensor keys, Tensor values, Tensor key_positions, "
      "Tensor positions, Tensor? rows, int context) -> Tensor",
      &ring_attention);
}
