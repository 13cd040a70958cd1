/* The vector math the native operators share (decoder_ops.cpp, row_attention.cpp): GCC/Clang
 * vector types and the exp polynomial, written once. */
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace intone {

/* Floats per vector: one register of the target. Wider types are not split into registers
 * where the target lacks them: GCC 12 on AVX2 passes a 16-float vector through the stack, and
 * the ELU took 3.4 ns per element with 16 lanes against 0.58 with 8 (one Zen 3 core). */
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#elif defined(__AVX__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4; /* SSE, NEON */
#endif

typedef float floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));

/* e^x for x <= 0 lane by lane, within 2 ulp of expf (Cephes' expf polynomial); below -87,
 * e^-87. */
inline floats exp_nonpositive(floats x) {
  const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  x = x < -87.0f ? floats{} - 87.0f : x;
  floats n = (x * 1.44269504088896341f + round) - round;
  floats r = x - n * 0.693359375f + n * 2.12194440e-4f;
  floats p = floats{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  ints bits = (__builtin_convertvector(n, ints) + 127) << 23;
  return p * (floats)bits;
}

/* ELU lane by lane: e^x - 1 for x <= 0 is within 1e-7 of expm1 (the reference's ELU). */
inline floats elu(floats v) {
  const floats e = exp_nonpositive(v < 0.0f ? v : floats{}) - 1.0f;
  return v > 0.0f ? v : e;
}

/* LANES floats from p, and v stored at p; unaligned. */
inline floats load_floats(const float* p) {
  floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_floats(float* p, floats v) { std::memcpy(p, &v, sizeof v); }

/* The first n (0 < n <= LANES) lanes at p, the others zero; and v's first n lanes stored at
 * p. Masked where the target has masks: a memcpy of a variable size is a library call. */
inline floats load_first(const float* p, int64_t n) {
#if defined(__AVX512F__)
  return (floats)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
  floats v = {};
  for (int64_t i = 0; i < n; i++) v[i] = p[i];
  return v;
#endif
}

inline void store_first(float* p, floats v, int64_t n) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
#else
  for (int64_t i = 0; i < n; i++) p[i] = v[i];
#endif
}

/* The sum of v's lanes, as a tree (a chain of lane-by-lane adds, which the compiler may not
 * reorder without -ffast-math, cost more than the dot product it ends). */
inline float sum_lanes(floats v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s[LANES];
  std::memcpy(s, &v, sizeof v);
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; i++) s[i] += s[i + width];
  return s[0];
#endif
}

/* Asks for the cache lines of `bytes` bytes from p on, ahead of their use. */
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

/* out[i] = f(in[i]) for n floats, a vector at a time; the tail through a zero-padded one. */
template <typename F>
void map_floats(const float* in, float* out, int64_t n, F f) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) store_floats(out + i, f(load_floats(in + i)));
  if (i < n) store_first(out + i, f(load_first(in + i, n - i)), n - i);
}

}  // namespace intone
