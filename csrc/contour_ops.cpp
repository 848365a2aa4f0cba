// CPU kernels of vllm-contour's ops (C++/OpenMP). Caches fp32 / bf16 / fp16 (compaction copies the
// bits of any 1/2/4/8-byte dtype); all arithmetic in fp32.
//
// Cache convention (see vllm_contour/ops/reference.py): key_cache / value_cache are [num_blocks, H, bs, D]
// views with arbitrary element strides, or the two-level [num_blocks, H, bs/tg, tg, D/dg, dg] form of packed
// page layouts (vLLM's AMX pages; vllm_contour/ops/cpu_layout.py): token t = t1*tg + t2, dim c = c1*dg + c2.
// Both are read through one description (Cache below); a head-page id is block * H + lane.
//
//   compact(kc, vc, src_page, src_off, dst_page, dst_off)          in place, overlap-safe
//   accumulate_moments(kc, vc, page_ids, offsets, head, n, sum_k, sum_v, sum_vk)   in place, fp32 stats
//   ragged_decode_attention(q, kc, vc, page_table, seq_lens, scale, [n, sum_k, sum_v, sum_vk]) -> (out, lse)
//   gather_pages([cache per layer], ids, out)                       head-pages into [L, M, bs, D] rows
// Light headers only (compiles in ~15 s instead of ~45 s with torch/extension.h); the ops are registered
// with the dispatcher (torch.ops.vllm_contour.*), the Python module itself is empty.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <Python.h>
#include <torch/library.h>

#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__F16C__) && defined(__AVX__)
#define CONTOUR_F16C 1
#endif

namespace {

using at::Tensor;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------------ views
// Element (page, token t, dim c) at base + block*s0 + lane*s1 + tok(t) + dim(c), with
// tok(t) = (t / tg) * ts1 + (t % tg) * ts2 and dim(c) = (c / dg) * cs1 + (c % dg) * cs2.
template <typename T>
struct Cache {
  T* base;
  int64_t s0, s1, heads, pages, bs, D;
  int64_t tg, ts1, ts2, dg, cs1, cs2;
  inline int64_t tok(int64_t off) const { return tg >= bs ? off * ts2 : (off / tg) * ts1 + (off % tg) * ts2; }
  inline T* row(int64_t page, int64_t off) const {
    return base + (page / heads) * s0 + (page % heads) * s1 + tok(off);
  }
  inline bool flat_dims() const { return dg >= D; }  // one stride (cs2) between a row's elements
};

// a row's pages lie anywhere in the cache, out of reach of the hardware prefetchers' streams: decode asks
// for a page's keys (then its values) this many pages ahead, into L2
constexpr int64_t kPrefetchPages = 2;
// decode's softmax runs over chunks of about this many tokens (their logits stay in L1)
constexpr int64_t kChunkTokens = 512;

template <typename T>
inline void prefetch_half(const Cache<T>& X, int64_t page) {  // a page's bs x D keys or values (contiguous)
  const char* b = reinterpret_cast<const char*>(X.row(page, 0));
  for (int64_t o = 0; o < X.bs * X.D * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(b + o, 0, 2);
}

inline int64_t cache_bs(const Tensor& c) { return c.dim() == 4 ? c.size(2) : c.size(2) * c.size(3); }
inline int64_t cache_d(const Tensor& c) { return c.dim() == 4 ? c.size(3) : c.size(4) * c.size(5); }

template <typename T>
Cache<T> cache_view(const Tensor& c) {
  Cache<T> x{reinterpret_cast<T*>(c.data_ptr()), c.stride(0), c.stride(1), c.size(1), c.size(0) * c.size(1),
             cache_bs(c), cache_d(c), 0, 0, 0, 0, 0, 0};
  if (c.dim() == 4) {
    x.tg = x.bs; x.ts2 = c.stride(2); x.dg = x.D; x.cs2 = c.stride(3);
  } else {
    x.tg = c.size(3); x.ts1 = c.stride(2); x.ts2 = c.stride(3);
    x.dg = c.size(5); x.cs1 = c.stride(4); x.cs2 = c.stride(5);
  }
  return x;
}

void check_cache_pair(const Tensor& kc, const Tensor& vc) {
  TORCH_CHECK((kc.dim() == 4 || kc.dim() == 6) && (vc.dim() == 4 || vc.dim() == 6),
              "caches must be [num_blocks, H, block_size, D] or [num_blocks, H, bs/tg, tg, D/dg, dg]");
  TORCH_CHECK(kc.size(0) == vc.size(0) && kc.size(1) == vc.size(1) && cache_bs(kc) == cache_bs(vc) &&
                  cache_d(kc) == cache_d(vc),
              "key_cache and value_cache shapes differ");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "key_cache and value_cache dtypes differ");
  TORCH_CHECK(kc.device().is_cpu() && vc.device().is_cpu(), "CPU kernels need CPU caches");
}

Tensor as_long(const Tensor& t) { return t.to(at::kLong).contiguous(); }

// ---------------------------------------------------------------------------------------- fp32 rows
inline void load_row(const double* p, int64_t s, int64_t D, float* __restrict out) {
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d * s]);
}

inline void load_row(const float* p, int64_t s, int64_t D, float* __restrict out) {
  if (s == 1) {
    std::memcpy(out, p, D * sizeof(float));
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = p[d * s];
  }
}

inline void load_row(const c10::BFloat16* p, int64_t s, int64_t D, float* __restrict out) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  if (s == 1) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(u[d]) << 16;
  } else {
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(u[d * s]) << 16;
  }
}

inline void load_row(const c10::Half* p, int64_t s, int64_t D, float* __restrict out) {
  int64_t d = 0;
#ifdef CONTOUR_F16C
  if (s == 1) {
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d))));
  }
#endif
  for (; d < D; ++d) out[d] = static_cast<float>(p[d * s]);
}

// one token row (D elements) of a cache into fp32
template <typename T>
inline void load_dims(const Cache<T>& X, const T* p, float* __restrict out) {
  if (X.flat_dims()) {
    load_row(p, X.cs2, X.D, out);
    return;
  }
  for (int64_t c = 0; c < X.D / X.dg; ++c) load_row(p + c * X.cs1, X.cs2, X.dg, out + c * X.dg);
}

// A two-level page whose (tg x dg) inner blocks are contiguous runs (vLLM's AMX packing: keys 16 tokens x
// 2 dims, values 2 tokens x 16 dims): read run by run in memory order, then placed.
template <typename T>
inline bool dense_blocks(const Cache<T>& X) {
  return X.tg < X.bs && !X.flat_dims() && ((X.ts2 == 1 && X.cs2 == X.tg) || (X.cs2 == 1 && X.ts2 == X.dg));
}

// tokens [0, n) of such a page into fp32 rows (out[t * D + c]) or columns (out[c * ld + t]); blk: tg*dg floats
template <bool COLUMNS, typename T>
void unpack_page(const Cache<T>& X, const T* base, int64_t n, float* __restrict out, int64_t ld,
                 float* __restrict blk) {
  const int64_t tg = X.tg, dg = X.dg, D = X.D, run = tg * dg;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 pairs (the AMX VNNI packing): one 32-bit word holds the two elements of a pair, so a word
    // splits into two fp32 values (low half << 16, high half masked) with contiguous loads and stores
    using u32a = uint32_t __attribute__((may_alias));
    constexpr uint32_t kHigh = 0xffff0000u;
    if (COLUMNS && dg == 2 && X.cs2 == 1 && X.ts2 == 2) {  // pairs of dims: word t2 of a run is token t2
      for (int64_t t1 = 0; t1 * tg < n; ++t1) {
        const int64_t nt = std::min(tg, n - t1 * tg);
        for (int64_t c1 = 0; c1 < D / 2; ++c1) {
          const u32a* w = reinterpret_cast<const u32a*>(base + t1 * X.ts1 + c1 * X.cs1);
          u32a* e = reinterpret_cast<u32a*>(out + 2 * c1 * ld + t1 * tg);
          u32a* o = reinterpret_cast<u32a*>(out + (2 * c1 + 1) * ld + t1 * tg);
#pragma omp simd
          for (int64_t t2 = 0; t2 < nt; ++t2) {
            const uint32_t x = w[t2];
            e[t2] = x << 16;
            o[t2] = x & kHigh;
          }
        }
      }
      return;
    }
    if (!COLUMNS && tg == 2 && X.ts2 == 1 && X.cs2 == 2) {  // pairs of tokens: word c2 of a run is dim c2
      for (int64_t t1 = 0; 2 * t1 < n; ++t1) {
        const bool both = 2 * t1 + 1 < n;
        for (int64_t c1 = 0; c1 < D / dg; ++c1) {
          const u32a* w = reinterpret_cast<const u32a*>(base + t1 * X.ts1 + c1 * X.cs1);
          u32a* e = reinterpret_cast<u32a*>(out + 2 * t1 * D + c1 * dg);
          if (both) {
            u32a* o = reinterpret_cast<u32a*>(out + (2 * t1 + 1) * D + c1 * dg);
#pragma omp simd
            for (int64_t c2 = 0; c2 < dg; ++c2) {
              const uint32_t x = w[c2];
              e[c2] = x << 16;
              o[c2] = x & kHigh;
            }
          } else {
#pragma omp simd
            for (int64_t c2 = 0; c2 < dg; ++c2) e[c2] = w[c2] << 16;
          }
        }
      }
      return;
    }
  }
  const bool rows_adjacent = X.cs1 == run;  // a token group's runs follow each other (AMX keys): one load
  for (int64_t t1 = 0; t1 * tg < n; ++t1) {
    const int64_t nt = std::min(tg, n - t1 * tg);
    if (rows_adjacent) load_row(base + t1 * X.ts1, 1, run * (D / dg), blk);
    for (int64_t c1 = 0; c1 < D / dg; ++c1) {
      const float* cur = blk;
      if (rows_adjacent)
        cur = blk + c1 * run;
      else
        load_row(base + t1 * X.ts1 + c1 * X.cs1, 1, run, blk);  // within the page even past n
      // the inner loop runs along the output (contiguous stores, strided fp32 reads of the run)
      if constexpr (COLUMNS) {
        for (int64_t c2 = 0; c2 < dg; ++c2) {
          float* __restrict o = out + (c1 * dg + c2) * ld + t1 * tg;
          const float* b = cur + c2 * X.cs2;
          const int64_t s = X.ts2;
#pragma omp simd
          for (int64_t t2 = 0; t2 < nt; ++t2) o[t2] = b[t2 * s];
        }
      } else {
        for (int64_t t2 = 0; t2 < nt; ++t2) {
          float* __restrict o = out + (t1 * tg + t2) * D + c1 * dg;
          const float* b = cur + t2 * X.ts2;
          const int64_t s = X.cs2;
#pragma omp simd
          for (int64_t c2 = 0; c2 < dg; ++c2) o[c2] = b[c2 * s];
        }
      }
    }
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// dots of q with 4 rows at once (4 independent accumulator chains)
inline void dot4(const float* __restrict q, const float* __restrict k, int64_t D, float* r) {
  const float *k0 = k, *k1 = k + D, *k2 = k + 2 * D, *k3 = k + 3 * D;
  float a = 0.f, b = 0.f, c = 0.f, e = 0.f;
#pragma omp simd reduction(+ : a, b, c, e)
  for (int64_t d = 0; d < D; ++d) {
    const float x = q[d];
    a += x * k0[d];
    b += x * k1[d];
    c += x * k2[d];
    e += x * k3[d];
  }
  r[0] = a;
  r[1] = b;
  r[2] = c;
  r[3] = e;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += a * x[d];
}

// y[0:D) += a0 x0 + a1 x1 + a2 x2 + a3 x3 with rows x_i = x + i * ld (ld defaults to D)
inline void axpy4(float* __restrict y, const float* a, const float* __restrict x, int64_t D, int64_t ld = -1) {
  if (ld < 0) ld = D;
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  const float *x0 = x, *x1 = x + ld, *x2 = x + 2 * ld, *x3 = x + 3 * ld;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += a0 * x0[d] + a1 * x1[d] + a2 * x2[d] + a3 * x3[d];
}

// exp(x) for the softmax (x <= 0 there): 2^(x log2 e) with a degree-6 polynomial for 2^f, f in [0, 1)
// (relative error ~2e-7), flushes below -87 to ~1e-38; vectorises (std::exp does not).
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t e = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// the softmax of a page's logits: their max, then x <- exp(x - m) in place, returning the sum
#if defined(__AVX512F__)
inline __m512 fast_exp16(__m512 x) {  // fast_exp on 16 lanes (same polynomial)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? __mmask16(0xffff) : __mmask16((1u << k) - 1); }

inline float row_max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
  }
  return _mm512_reduce_max_ps(m);
}

inline float exp_in_place(float* x, int64_t n, float mx) {
  __m512 s = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
    _mm512_mask_storeu_ps(x + i, k, e);
    s = _mm512_mask_add_ps(s, k, s, e);
  }
  return _mm512_reduce_add_ps(s);
}
#else
inline float row_max(const float* x, int64_t n) {
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

inline float exp_in_place(float* x, int64_t n, float mx) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const float e = fast_exp(x[i] - mx);
    x[i] = e;
    s += e;
  }
  return s;
}
#endif

inline void scal(float* y, float a, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] *= a;
}

// ------------------------------------------------------------------------- bf16 pairs (AVX-512)
// vLLM's AMX bf16 packing holds a page's keys as 64-byte runs of 16 tokens x 2 dims and its values as runs
// of 2 tokens x 16 dims: each 32-bit word is a pair of bf16 elements. Decode reads such a page straight
// from the words into registers (low half << 16 and high half masked are the pair's two fp32 values):
// exact fp32 products, FMAs with independent accumulator chains, no unpacked copy of the page.
#if defined(__AVX512F__)
#define CONTOUR_PAIRS 1
template <typename T>
inline bool pair_pages(const Cache<T>& K, const Cache<T>& V, int64_t D) {
  return K.bs % 32 == 0 && D % 32 == 0 &&  //
         K.tg == 16 && K.dg == 2 && K.cs2 == 1 && K.ts2 == 2 &&                 // keys: 16 tokens x 2 dims
         V.tg == 2 && V.dg == 16 && V.ts2 == 1 && V.cs2 == 2;                   // values: 2 tokens x 16 dims
}

inline __m512 pair_lo(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 pair_hi(__m512i w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// logits of tokens [32 u, 32 u + 32) of a key page (two 16-token groups) for NG queries (scaled, fp32 rows
// of D): lg[g * ld + t]
template <int NG, typename T>
inline void pair_logits32(const Cache<T>& K, int64_t page, int64_t u, const float* qs, int64_t D, float* lg,
                          int64_t ld) {
  const T* b0 = K.row(page, 0) + 2 * u * K.ts1;  // token groups 2u and 2u + 1
  const T* b1 = b0 + K.ts1;
  __m512 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t c1 = 0; c1 < D / 2; ++c1) {
    const __m512i w0 = _mm512_loadu_si512(b0 + c1 * K.cs1), w1 = _mm512_loadu_si512(b1 + c1 * K.cs1);
    const __m512 e0 = pair_lo(w0), o0 = pair_hi(w0), e1 = pair_lo(w1), o1 = pair_hi(w1);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512 qe = _mm512_set1_ps(qs[g * D + 2 * c1]), qo = _mm512_set1_ps(qs[g * D + 2 * c1 + 1]);
      a[g][0] = _mm512_fmadd_ps(e0, qe, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(o0, qo, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(e1, qe, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(o1, qo, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    _mm512_storeu_ps(lg + g * ld + 32 * u, _mm512_add_ps(a[g][0], a[g][1]));
    _mm512_storeu_ps(lg + g * ld + 32 * u + 16, _mm512_add_ps(a[g][2], a[g][3]));
  }
}

#if defined(__AVX512BF16__)
// the same from the query's own bf16 pairs (qw: words of dims 2c, 2c + 1, low half first), with AVX-512-BF16
// dot products of pairs: exact products, fp32 sums (denormals flushed); the scale applied to the sums
template <int NG, typename T>
inline void pair_logits32_bf16(const Cache<T>& K, int64_t page, int64_t u, const uint32_t* qw, float scale,
                               int64_t D, float* lg, int64_t ld) {
  const T* b0 = K.row(page, 0) + 2 * u * K.ts1;
  const T* b1 = b0 + K.ts1;
  __m512 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t c1 = 0; c1 < D / 2; c1 += 2) {  // D % 32 == 0: pairs of dim pairs
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + c1 * K.cs1);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + c1 * K.cs1);
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(b0 + (c1 + 1) * K.cs1);
    const __m512bh x1 = (__m512bh)_mm512_loadu_si512(b1 + (c1 + 1) * K.cs1);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512bh q0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[g * (D / 2) + c1]));
      const __m512bh q1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[g * (D / 2) + c1 + 1]));
      a[g][0] = _mm512_dpbf16_ps(a[g][0], w0, q0);
      a[g][1] = _mm512_dpbf16_ps(a[g][1], w1, q0);
      a[g][2] = _mm512_dpbf16_ps(a[g][2], x0, q1);
      a[g][3] = _mm512_dpbf16_ps(a[g][3], x1, q1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < NG; ++g) {
    _mm512_storeu_ps(lg + g * ld + 32 * u, _mm512_mul_ps(_mm512_add_ps(a[g][0], a[g][2]), sc));
    _mm512_storeu_ps(lg + g * ld + 32 * u + 16, _mm512_mul_ps(_mm512_add_ps(a[g][1], a[g][3]), sc));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CONTOUR_AMX 1
// AMX tiles for the logits of a bf16 query group against keys in vLLM's AMX packing: a 16-token group's keys
// over 32 dims are one B tile as they lie in the cache (16 rows of dim pairs, 64 bytes each: 16 tokens),
// the group's queries (<= 16 rows) the A tiles, so one TDPBF16PS gives the G x 16 logits of 32 dims. The
// process asks Linux for the tile state once (as vLLM's worker does); when that fails the AVX-512 path runs.
// VLLM_CONTOUR_NO_AMX=1 keeps the AVX-512 path (the tests run both on an AMX machine).
bool amx_usable() {
  static const bool ok = [] {
    const char* off = std::getenv("VLLM_CONTOUR_NO_AMX");
    if (off != nullptr && std::strcmp(off, "1") == 0) return false;
    constexpr long kReqPerm = 0x1023, kXtiledata = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: the queries' dims [32 i, 32 i + 32) (D / 32 of them), 4: keys, 5 and 6: logits of the page's
// two token groups
inline void amx_configure(int64_t G, int64_t D) {
  TileConfig c;
  for (int i = 0; i < D / 32; ++i) c.rows[i] = static_cast<uint8_t>(G), c.colsb[i] = 64;
  c.rows[4] = 16, c.colsb[4] = 64;
  c.rows[5] = c.rows[6] = static_cast<uint8_t>(G), c.colsb[5] = c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

inline void amx_load_queries(const uint32_t* qw, int64_t D) {  // qw: G rows of D bf16 (as dim pairs)
  const int64_t stride = D * 2;
  _tile_loadd(0, qw, stride);
  _tile_loadd(1, qw + 16, stride);
  if (D == 128) {
    _tile_loadd(2, qw + 32, stride);
    _tile_loadd(3, qw + 48, stride);
  }
}

// logits (scaled) of tokens [32 u, 32 u + 32) of a key page into lg[g * ld + t]
template <typename T>
inline void amx_logits32(const Cache<T>& K, int64_t page, int64_t u, float scale, int64_t G, int64_t D, float* lg,
                         int64_t ld) {
  const T* b0 = K.row(page, 0) + 2 * u * K.ts1;
  const T* b1 = b0 + K.ts1;
  const int64_t kstride = K.cs1 * static_cast<int64_t>(sizeof(T)), chunk = 16 * K.cs1;  // 16 dim pairs
  _tile_zero(5);
  _tile_zero(6);
  _tile_loadd(4, b0, kstride);
  _tile_dpbf16ps(5, 0, 4);
  _tile_loadd(4, b1, kstride);
  _tile_dpbf16ps(6, 0, 4);
  _tile_loadd(4, b0 + chunk, kstride);
  _tile_dpbf16ps(5, 1, 4);
  _tile_loadd(4, b1 + chunk, kstride);
  _tile_dpbf16ps(6, 1, 4);
  if (D == 128) {
    _tile_loadd(4, b0 + 2 * chunk, kstride);
    _tile_dpbf16ps(5, 2, 4);
    _tile_loadd(4, b1 + 2 * chunk, kstride);
    _tile_dpbf16ps(6, 2, 4);
    _tile_loadd(4, b0 + 3 * chunk, kstride);
    _tile_dpbf16ps(5, 3, 4);
    _tile_loadd(4, b1 + 3 * chunk, kstride);
    _tile_dpbf16ps(6, 3, 4);
  }
  float* l = lg + 32 * u;
  _tile_stored(5, l, ld * 4);
  _tile_stored(6, l + 16, ld * 4);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    _mm512_storeu_ps(l + g * ld, _mm512_mul_ps(_mm512_loadu_ps(l + g * ld), sc));
    _mm512_storeu_ps(l + g * ld + 16, _mm512_mul_ps(_mm512_loadu_ps(l + g * ld + 16), sc));
  }
}
#endif

// acc[g * D + c] += sum_t p[g * ld + t] v[t, c] over the page's tokens [0, n), dims [16 c0, 16 (c0 + NC)):
// NG x NC accumulators (one chain each) stay in registers over the page's token pairs
template <int NG, int NC, typename T>
inline void pair_values(const Cache<T>& V, int64_t page, int64_t n, int64_t c0, const float* p, int64_t ld,
                        float* acc, int64_t D) {
  __m512 a[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NC; ++i) a[g][i] = _mm512_setzero_ps();
  const T* base = V.row(page, 0) + c0 * V.cs1;
  // whole token pairs, then an odd last token alone (the other half of its words may hold anything: a NaN
  // times a zero weight would still be NaN)
  const int64_t pairs = n / 2;
  for (int64_t t1 = 0; t1 < pairs; ++t1) {
    __m512i w[NC];
    for (int i = 0; i < NC; ++i) w[i] = _mm512_loadu_si512(base + t1 * V.ts1 + i * V.cs1);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512 pe = _mm512_set1_ps(p[g * ld + 2 * t1]), po = _mm512_set1_ps(p[g * ld + 2 * t1 + 1]);
      for (int i = 0; i < NC; ++i) {
        a[g][i] = _mm512_fmadd_ps(pair_lo(w[i]), pe, a[g][i]);
        a[g][i] = _mm512_fmadd_ps(pair_hi(w[i]), po, a[g][i]);
      }
    }
  }
  if (n % 2) {
    for (int i = 0; i < NC; ++i) {
      const __m512 e = pair_lo(_mm512_loadu_si512(base + pairs * V.ts1 + i * V.cs1));
      for (int g = 0; g < NG; ++g) a[g][i] = _mm512_fmadd_ps(e, _mm512_set1_ps(p[g * ld + n - 1]), a[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NC; ++i) {
      float* y = acc + g * D + 16 * (c0 + i);
      _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), a[g][i]));
    }
}


// one page of one KV head's G queries: logits of tokens [0, n) into lg (row stride ld), or the values
// weighted by lg into acc; groups of up to 4 queries per pass (accumulators stay in registers)
template <typename T>
void pair_page_logits(const Cache<T>& K, int64_t page, int64_t n, const float* qs, const uint32_t* qw, float scale,
                      int64_t G, int64_t D, float* lg, int64_t ld) {
  for (int64_t u = 0; 32 * u < n; ++u)
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* q = qs + g0 * D;
      float* l = lg + g0 * ld;
#if defined(__AVX512BF16__)
      if (qw != nullptr) {
        const uint32_t* w = qw + g0 * (D / 2);
        switch (std::min<int64_t>(4, G - g0)) {
          case 1: pair_logits32_bf16<1>(K, page, u, w, scale, D, l, ld); break;
          case 2: pair_logits32_bf16<2>(K, page, u, w, scale, D, l, ld); break;
          case 3: pair_logits32_bf16<3>(K, page, u, w, scale, D, l, ld); break;
          default: pair_logits32_bf16<4>(K, page, u, w, scale, D, l, ld); break;
        }
        continue;
      }
#endif
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: pair_logits32<1>(K, page, u, q, D, l, ld); break;
        case 2: pair_logits32<2>(K, page, u, q, D, l, ld); break;
        case 3: pair_logits32<3>(K, page, u, q, D, l, ld); break;
        default: pair_logits32<4>(K, page, u, q, D, l, ld); break;
      }
    }
}

template <int NG, typename T>
void pair_page_values_ng(const Cache<T>& V, int64_t page, int64_t n, const float* p, int64_t ld, float* acc,
                         int64_t D) {
  int64_t c0 = 0;  // 64 dims per pass while they last, then 32 (D % 32 == 0)
  for (; 16 * (c0 + 4) <= D; c0 += 4) pair_values<NG, 4>(V, page, n, c0, p, ld, acc, D);
  if (16 * c0 < D) pair_values<NG, 2>(V, page, n, c0, p, ld, acc, D);
}

template <typename T>
void pair_page_values(const Cache<T>& V, int64_t page, int64_t n, const float* lg, int64_t ld, int64_t G, int64_t D,
                      float* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* p = lg + g0 * ld;
    float* a = acc + g0 * D;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: pair_page_values_ng<1>(V, page, n, p, ld, a, D); break;
      case 2: pair_page_values_ng<2>(V, page, n, p, ld, a, D); break;
      case 3: pair_page_values_ng<3>(V, page, n, p, ld, a, D); break;
      default: pair_page_values_ng<4>(V, page, n, p, ld, a, D); break;
    }
  }
}
#endif

// ------------------------------------------------------------------------------ vec pages (AVX-512)
// vLLM's vec / vec16 kernels keep a page's keys transposed ([D, bs]: a dim's tokens contiguous) and its
// values as token rows, in fp32, bf16 or fp16. Decode reads both straight from the page, 16 elements at a
// time widened to fp32: the logits of NG queries x 32 tokens and the weighted values of NG queries x 64
// dims stay in registers (no unpacked copy of the page).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CONTOUR_VEC_PAGES 1
inline __mmask16 lanes_from(int64_t k) { return k <= 0 ? __mmask16(0) : first_lanes(k); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
template <typename T>
inline __m512 load16(const T* p) {
  return load16(p, __mmask16(0xffff));
}

template <typename T>
inline bool vec_pages(const Cache<T>& K, const Cache<T>& V, int64_t D) {
  constexpr bool widened = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
  return widened && D % 16 == 0 && D > 1 &&                             //
         K.tg >= K.bs && K.flat_dims() && K.ts2 == 1 && K.cs2 != 1 &&  // keys [D, bs]
         V.tg >= V.bs && V.flat_dims() && V.cs2 == 1;                  // values [bs, D]
}

// logits of tokens [0, n) of a transposed key page (k: dim d's tokens at k + d * cs) into lg[g * ld + t]
template <int NG, typename T>
inline void vec_logits(const T* k, int64_t cs, int64_t n, const float* qs, int64_t D, float* lg, int64_t ld) {
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const __mmask16 m0 = lanes_from(n - j0), m1 = lanes_from(n - j0 - 16);
    __m512 a[NG][2];
    for (int g = 0; g < NG; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const T* r = k + d * cs + j0;
      const __m512 x0 = load16(r, m0), x1 = load16(r + 16, m1);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m512 qd = _mm512_set1_ps(qs[g * D + d]);
        a[g][0] = _mm512_fmadd_ps(x0, qd, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(x1, qd, a[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm512_mask_storeu_ps(lg + g * ld + j0, m0, a[g][0]);
      _mm512_mask_storeu_ps(lg + g * ld + j0 + 16, m1, a[g][1]);
    }
  }
}

// acc[g * D + c] += sum_t p[g * ld + t] v[t, c], dims [16 c0, 16 (c0 + NC)) (v: token t's row at v + t * ts)
template <int NG, int NC, typename T>
inline void vec_values(const T* v, int64_t ts, int64_t n, int64_t c0, const float* p, int64_t ld, float* acc,
                       int64_t D) {
  __m512 a[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NC; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 w[NC];
    for (int i = 0; i < NC; ++i) w[i] = load16(v + t * ts + 16 * (c0 + i));
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * ld + t]);
      for (int i = 0; i < NC; ++i) a[g][i] = _mm512_fmadd_ps(w[i], pt, a[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NC; ++i) {
      float* y = acc + g * D + 16 * (c0 + i);
      _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), a[g][i]));
    }
}

template <int NG, typename T>
inline void vec_values_ng(const T* v, int64_t ts, int64_t n, const float* p, int64_t ld, float* acc, int64_t D) {
  int64_t c0 = 0;  // 64 dims per pass while they last, then 16 at a time
  for (; 16 * (c0 + 4) <= D; c0 += 4) vec_values<NG, 4>(v, ts, n, c0, p, ld, acc, D);
  for (; 16 * c0 < D; ++c0) vec_values<NG, 1>(v, ts, n, c0, p, ld, acc, D);
}

// one page of one KV head's G queries (groups of up to 4 per pass): logits of tokens [0, n) into lg (row
// stride ld), or the values weighted by lg into acc
template <typename T>
inline void vec_page_logits(const T* k, int64_t cs, int64_t n, const float* qs, int64_t G, int64_t D, float* lg,
                            int64_t ld) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: vec_logits<1>(k, cs, n, qs + g0 * D, D, lg + g0 * ld, ld); break;
      case 2: vec_logits<2>(k, cs, n, qs + g0 * D, D, lg + g0 * ld, ld); break;
      case 3: vec_logits<3>(k, cs, n, qs + g0 * D, D, lg + g0 * ld, ld); break;
      default: vec_logits<4>(k, cs, n, qs + g0 * D, D, lg + g0 * ld, ld); break;
    }
  }
}

template <typename T>
inline void vec_page_values(const T* v, int64_t ts, int64_t n, const float* p, int64_t ld, int64_t G, int64_t D,
                            float* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: vec_values_ng<1>(v, ts, n, p + g0 * ld, ld, acc + g0 * D, D); break;
      case 2: vec_values_ng<2>(v, ts, n, p + g0 * ld, ld, acc + g0 * D, D); break;
      case 3: vec_values_ng<3>(v, ts, n, p + g0 * ld, ld, acc + g0 * D, D); break;
      default: vec_values_ng<4>(v, ts, n, p + g0 * ld, ld, acc + g0 * D, D); break;
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------- compact
// q = n / d, r = n % d for 0 <= n < 2^52 through a double reciprocal (a 64-bit division costs ~40 cycles,
// one per moved token per cache would dominate a row copy)
struct DivMod {
  int64_t d;
  double inv;
  explicit DivMod(int64_t d_) : d(d_), inv(1.0 / static_cast<double>(d_)) {}
  inline void operator()(int64_t n, int64_t& q, int64_t& r) const {
    // (n + 0.5) / d = q + (r + 0.5) / d stays clear of integers: the fix-ups below never fire in practice
    q = static_cast<int64_t>((static_cast<double>(n) + 0.5) * inv);
    r = n - q * d;
    if (r < 0) {
      --q;
      r += d;
    } else if (r >= d) {
      ++q;
      r -= d;
    }
  }
};

template <int64_t BYTES>
inline void copy_fixed(void* dst, const void* src) {
#if defined(__AVX__)
  if constexpr (BYTES % 32 == 0) {  // 32-byte moves (GCC's inline memcpy uses 16-byte ones here)
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    __m256i r[BYTES / 32];
    for (int64_t i = 0; i < BYTES / 32; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32 * i));
    for (int64_t i = 0; i < BYTES / 32; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 32 * i), r[i]);
    return;
  }
#endif
  std::memcpy(dst, src, BYTES);  // constant size: inlined vector moves
}

// copy one row of D elements (element strides ds / ss)
template <typename U>
inline void copy_row(U* dst, int64_t ds, const U* src, int64_t ss, int64_t D) {
  if (ds == 1 && ss == 1) {
    switch (D * static_cast<int64_t>(sizeof(U))) {
      case 64: copy_fixed<64>(dst, src); return;
      case 128: copy_fixed<128>(dst, src); return;
      case 256: copy_fixed<256>(dst, src); return;
      case 512: copy_fixed<512>(dst, src); return;
      default: std::memcpy(dst, src, D * sizeof(U)); return;
    }
  }
  for (int64_t d = 0; d < D; ++d) dst[d * ds] = src[d * ss];
}

// one token row between cache rows (layout addressing) and / or a contiguous buffer row
// n words of type W at word strides ds / ss (one chunk of a two-level row per word)
template <typename W>
inline void copy_words(void* dst, int64_t ds, const void* src, int64_t ss, int64_t n) {
  W* d = static_cast<W*>(dst);
  const W* s = static_cast<const W*>(src);
  for (int64_t i = 0; i < n; ++i) {
    W w;
    std::memcpy(&w, s + i * ss, sizeof(W));
    std::memcpy(d + i * ds, &w, sizeof(W));
  }
}

#if defined(CONTOUR_PAIRS) && defined(__AVX512BW__)
#define CONTOUR_HALF_MOVES 1
// vLLM's AMX value packing (runs of 2 tokens x 16 dims): a token is one 16-bit half of each of its runs'
// 16 words. A move loads the source run, brings the token's half to the destination's half and stores
// only those halves (a masked store: the other token's halves are never written, so moves of the two
// tokens of a word may run on different threads).
template <typename U>
inline bool half_runs(const Cache<U>& X) {
  return sizeof(U) == 2 && X.tg == 2 && X.ts2 == 1 && X.cs2 == 2 && X.dg == 16 && X.D % 16 == 0;
}

// dst / src: the token's element in the cache, or a contiguous row of D elements (the overlap buffer)
template <typename U>
inline void move_half_runs(const Cache<U>& X, U* dst, bool dst_cache, const U* src, bool src_cache) {
  const bool s_hi = src_cache && (reinterpret_cast<uintptr_t>(src) & 2);
  const bool d_hi = dst_cache && (reinterpret_cast<uintptr_t>(dst) & 2);
  const __mmask32 keep = d_hi ? 0xAAAAAAAAu : 0x55555555u;
  const U* s0 = src - (s_hi ? 1 : 0);
  U* d0 = dst - (d_hi ? 1 : 0);
  for (int64_t c = 0; c < X.D / 16; ++c) {
    __m512i w;  // the token's 16 elements in the low halves of 16 words (when !d_hi)
    if (src_cache) {
      w = _mm512_loadu_si512(s0 + c * X.cs1);
      if (s_hi && !d_hi) w = _mm512_srli_epi32(w, 16);
      if (!s_hi && d_hi) w = _mm512_slli_epi32(w, 16);
    } else {
      w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + 16 * c)));
      if (d_hi) w = _mm512_slli_epi32(w, 16);
    }
    if (dst_cache)
      _mm512_mask_storeu_epi16(d0 + c * X.cs1, keep, w);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d0 + 16 * c), _mm512_cvtepi32_epi16(w));
  }
}
#endif

template <typename U>
inline void move_row(const Cache<U>& X, U* dst, bool dst_cache, const U* src, bool src_cache) {
#ifdef CONTOUR_HALF_MOVES
  if constexpr (sizeof(U) == 2) {
    if (half_runs(X)) {
      move_half_runs(X, dst, dst_cache, src, src_cache);
      return;
    }
  }
#endif
  if (X.flat_dims()) {
    copy_row<U>(dst, dst_cache ? X.cs2 : 1, src, src_cache ? X.cs2 : 1, X.D);
    return;
  }
  // contiguous chunks of dg elements (the AMX key packing: pairs of dims): one word per chunk
  const int64_t n1 = X.D / X.dg, bytes = X.dg * static_cast<int64_t>(sizeof(U));
  if (X.cs2 == 1 && (X.cs1 * static_cast<int64_t>(sizeof(U))) % bytes == 0) {
    const int64_t ds = dst_cache ? X.cs1 / X.dg : 1, ss = src_cache ? X.cs1 / X.dg : 1;
    switch (bytes) {
      case 2: copy_words<uint16_t>(dst, ds, src, ss, n1); return;
      case 4: copy_words<uint32_t>(dst, ds, src, ss, n1); return;
      case 8: copy_words<uint64_t>(dst, ds, src, ss, n1); return;
      default: break;
    }
  }
  for (int64_t c = 0; c < X.D / X.dg; ++c)
    copy_row<U>(dst + c * (dst_cache ? X.cs1 : X.dg), dst_cache ? X.cs2 : 1,
                src + c * (src_cache ? X.cs1 : X.dg), src_cache ? X.cs2 : 1, X.dg);
}

#if defined(CONTOUR_VEC_PAGES)
#define CONTOUR_COLUMN_MOVES 1
// Pages whose columns (one dim, or one pair of dims, of consecutive tokens) are runs of 2- or 4-byte words,
// one per token: vLLM's vec layouts (keys [D, bs]) and its AMX packing (keys in 16-token groups of dim
// pairs). A token's move writes one word in each column. A run of moves to consecutive tokens of one
// group, whose sources lie in one window of two vectors (2 x 64 bytes of a column) of one page, moves
// together: per column, two loads (whole 64-byte vectors inside the column; lanes that are not the run's
// sources are never used), one two-source permute and one masked store.
struct Columns {
  int64_t word = 0, count = 0, stride = 0, lanes = 0;  // word bytes, columns, column stride (elements), words / 64 B
};

template <typename U>
inline bool word_columns(const Cache<U>& X, Columns& c) {
  const int64_t es = static_cast<int64_t>(sizeof(U));
  if (X.D < 2) return false;
  if (X.flat_dims()) {
    if (X.ts2 != 1) return false;
    c.word = es, c.count = X.D, c.stride = X.cs2;
  } else {
    if (X.cs2 != 1 || X.ts2 != X.dg) return false;
    c.word = X.dg * es, c.count = X.D / X.dg, c.stride = X.cs1;
  }
  if (c.word != 4 && c.word != 2) return false;
  c.lanes = 64 / c.word;
  // a window's two vectors each lie inside one group of a column
  return std::min(X.tg, X.bs) % c.lanes == 0;
}

// A run: moves [i0, i0 + r) to consecutive tokens of one group, their sources in the window [w0, w0 + 2 *
// lanes) of one page, read in place or, where another move writes one of them first, from a copy of the
// window set aside before the pass (aside >= 0: its index).
struct ColumnRun {
  int64_t i0, r, w0, aside;
};

// The window's two vectors in column j: a + j * stride, b + j * stride (bytes).
struct Window {
  const char *a, *b;
  int64_t stride;
};

template <typename U>
inline Window cache_window(const Cache<U>& X, const Columns& c, int64_t src_page, int64_t w0) {
  const int64_t es = static_cast<int64_t>(sizeof(U));
  const char* a = reinterpret_cast<const char*>(X.base + src_page + X.tok(w0));
  // past the page's last token no run's index reaches the second vector: it is then the first again
  const char* b = w0 + c.lanes < X.bs ? reinterpret_cast<const char*>(X.base + src_page + X.tok(w0 + c.lanes)) : a;
  return {a, b, c.stride * es};
}

// copies the window's columns (128 bytes each) to out
inline void set_window_aside(const Columns& c, const Window& w, char* out) {
  for (int64_t j = 0; j < c.count; ++j, out += 128) {
    _mm512_storeu_si512(out, _mm512_loadu_si512(w.a + j * w.stride));
    _mm512_storeu_si512(out + 64, _mm512_loadu_si512(w.b + j * w.stride));
  }
}

// per column: the run's source words gathered from the window by one two-source permute, one masked store
inline void move_columns(const Columns& c, const Window& w, const int64_t* so, int64_t w0, int64_t i0, int64_t r,
                         char* d, int64_t dstride) {
  alignas(64) uint16_t idx[32] = {};
  for (int64_t k = 0; k < r; ++k) idx[k] = static_cast<uint16_t>(so[i0 + k] - w0);
  const char *a = w.a, *b = w.b;
  if (c.word == 4) {
    const __m512i vi = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(idx)));
    const __mmask16 md = first_lanes(r);
    for (int64_t j = 0; j < c.count; ++j, a += w.stride, b += w.stride, d += dstride)
      _mm512_mask_storeu_epi32(d, md, _mm512_permutex2var_epi32(_mm512_loadu_si512(a), vi, _mm512_loadu_si512(b)));
  } else {
    const __m512i vi = _mm512_load_si512(idx);
    const __mmask32 md = r >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << r) - 1);
    for (int64_t j = 0; j < c.count; ++j, a += w.stride, b += w.stride, d += dstride)
      _mm512_mask_storeu_epi16(d, md, _mm512_permutex2var_epi16(_mm512_loadu_si512(a), vi, _mm512_loadu_si512(b)));
  }
}
#endif

// Moves run in their order, one thread, up to this many; more are split over threads in any order.
constexpr int64_t kOrderedMoves = 8192;
// compaction asks for a row's source this many moves ahead (a run's source page: kPrefetchPages runs ahead)
constexpr int64_t kPrefetchRows = 8;

// Which moves read a slot that another move writes first ("clobbered" sources)? Only those go through a
// temporary buffer; every other source is read in place. Moves run in order (ordered): a source is
// clobbered when an earlier move writes it (a compaction towards the front of its row clobbers none);
// otherwise, or over a sparse range of destinations, when any other move writes it. Fills the temporary
// row of every move (-1: read in place), returns the number of clobbered moves. [lo, hi]: the range of
// destination slot keys (page * bs + offset).
int64_t clobbered_slots(const int64_t* sp, const int64_t* so, const int64_t* dp, const int64_t* dof, int64_t M,
                        int64_t bs, int64_t lo, int64_t hi, bool ordered, int64_t* slot) {
  int64_t C = 0;
  const int64_t range = hi - lo + 1;
  auto moved = [&](int64_t i) { return sp[i] != dp[i] || so[i] != dof[i]; };
  if (range <= std::max<int64_t>(64 * M, int64_t(1) << 22)) {  // dense bitmap of destination slots
    std::unique_ptr<uint64_t[]> bits(new uint64_t[(range + 63) / 64]());
    auto mark = [&](int64_t i) {
      const int64_t r = dp[i] * bs + dof[i] - lo;
      bits[r >> 6] |= uint64_t(1) << (r & 63);
    };
    if (!ordered)
      for (int64_t i = 0; i < M; ++i) mark(i);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t r = sp[i] * bs + so[i] - lo;
      const bool hit = static_cast<uint64_t>(r) < static_cast<uint64_t>(range) &&
                       ((bits[r >> 6] >> (r & 63)) & 1) && moved(i);
      slot[i] = hit ? C++ : -1;
      if (ordered) mark(i);
    }
  } else {  // sparse (any order): sorted destination slots + binary search
    std::vector<int64_t> dst(M);
    for (int64_t i = 0; i < M; ++i) dst[i] = dp[i] * bs + dof[i];
    std::sort(dst.begin(), dst.end());
    for (int64_t i = 0; i < M; ++i) {
      const bool hit = moved(i) && std::binary_search(dst.begin(), dst.end(), sp[i] * bs + so[i]);
      slot[i] = hit ? C++ : -1;
    }
  }
  return C;
}

template <typename U>
void compact_kernel(const Tensor& kc, const Tensor& vc, const int64_t* sp, const int64_t* so, const int64_t* dp,
                    const int64_t* dof, int64_t M) {
  Cache<U> K = cache_view<U>(kc), V = cache_view<U>(vc);
  const int64_t D = K.D;
  // element offsets of every source / destination row, K and V (one divmod per page id)
  std::unique_ptr<int64_t[]> off(new int64_t[4 * M]);
  int64_t* ks = off.get();
  int64_t* vs = ks + M;
  int64_t* kd = vs + M;
  int64_t* vd = kd + M;
  const DivMod dm(K.heads);
  const int64_t pages = K.pages, bs = K.bs;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  // consecutive moves mostly share their source and destination pages: divide once per page change
  int64_t last_s = -1, last_d = -1, sk = 0, sv = 0, dk = 0, dv = 0;
  bool ok = true;
  for (int64_t i = 0; i < M; ++i) {
    ok &= (static_cast<uint64_t>(sp[i]) < static_cast<uint64_t>(pages)) &
          (static_cast<uint64_t>(so[i]) < static_cast<uint64_t>(bs)) &
          (static_cast<uint64_t>(dp[i]) < static_cast<uint64_t>(pages)) &
          (static_cast<uint64_t>(dof[i]) < static_cast<uint64_t>(bs));
    if (!ok) break;
    int64_t b, l;
    if (sp[i] != last_s) {
      dm(sp[i], b, l);
      sk = b * K.s0 + l * K.s1;
      sv = b * V.s0 + l * V.s1;
      last_s = sp[i];
    }
    if (dp[i] != last_d) {
      dm(dp[i], b, l);
      dk = b * K.s0 + l * K.s1;
      dv = b * V.s0 + l * V.s1;
      last_d = dp[i];
    }
    ks[i] = sk + K.tok(so[i]);
    vs[i] = sv + V.tok(so[i]);
    kd[i] = dk + K.tok(dof[i]);
    vd[i] = dv + V.tok(dof[i]);
    const int64_t key = dp[i] * bs + dof[i];
    lo = std::min(lo, key);
    hi = std::max(hi, key);
  }
  if (!ok) {
    for (int64_t i = 0; i < M; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < pages && so[i] >= 0 && so[i] < bs && dp[i] >= 0 && dp[i] < pages &&
                      dof[i] >= 0 && dof[i] < bs,
                  "compact: move ", i, " (page ", sp[i], ", offset ", so[i], ") -> (page ", dp[i], ", offset ",
                  dof[i], ") is outside the cache (", pages, " head-pages x ", bs, ")");
  }
  std::unique_ptr<int64_t[]> slot_buf(new int64_t[M]);
  int64_t* slot = slot_buf.get();  // row in the temporary buffer, -1: read in place
  const int64_t C = clobbered_slots(sp, so, dp, dof, M, bs, lo, hi, M <= kOrderedMoves, slot);
  std::unique_ptr<U[]> tmp(new U[C * D + 1]);  // uninitialised
  // K and V in separate passes: interleaving them makes every load 4 KiB-alias the previous store in
  // vLLM's CPU layout (V rows sit bs*D elements after the K rows) and ran ~4x slower than a strided copy.
  for (int pass = 0; pass < 2; ++pass) {
    const Cache<U>& X = pass == 0 ? K : V;
    const int64_t* xs = pass == 0 ? ks : vs;
    const int64_t* xd = pass == 0 ? kd : vd;
    auto one = [&](int64_t i) {
      if (xs[i] == xd[i]) return;  // a self move
      if (slot[i] >= 0)
        move_row<U>(X, X.base + xd[i], true, tmp.get() + slot[i] * D, false);
      else
        move_row<U>(X, X.base + xd[i], true, X.base + xs[i], true);
    };
    auto aside = [&](int64_t i) {
      if (slot[i] >= 0) move_row<U>(X, tmp.get() + slot[i] * D, false, X.base + xs[i], true);
    };
#ifdef CONTOUR_COLUMN_MOVES
    Columns col;
    if (word_columns(X, col)) {
      // runs of 2+ moves (r == 1: moved one by one); a run with a clobbered source reads its window from a
      // copy set aside before the pass
      const int64_t L = col.lanes, group = std::min(X.tg, X.bs);
      std::vector<ColumnRun> runs;
      runs.reserve(M / 4 + 1);
      int64_t windows = 0;
      for (int64_t i = 0; i < M;) {
        const int64_t w0 = so[i] & ~(L - 1), last = std::min(L, (dof[i] / group + 1) * group - dof[i]);
        bool set_aside = slot[i] >= 0;
        int64_t r = 1;
        while (i + r < M && r < last && dp[i + r] == dp[i] && dof[i + r] == dof[i] + r && sp[i + r] == sp[i] &&
               so[i + r] >= w0 && so[i + r] < w0 + 2 * L) {
          set_aside |= slot[i + r] >= 0;
          ++r;
        }
        runs.push_back({i, r, w0, r > 1 && set_aside ? windows++ : -1});
        i += r;
      }
      const int64_t R = static_cast<int64_t>(runs.size());
      auto window = [&](const ColumnRun& run) {
        return cache_window(X, col, xs[run.i0] - X.tok(so[run.i0]), run.w0);
      };
      std::unique_ptr<char[]> wbuf(new char[windows * col.count * 128 + 1]);
      if (C > 0) {
#pragma omp parallel for schedule(static) if (M > kOrderedMoves)
        for (int64_t k = 0; k < R; ++k) {
          const ColumnRun& run = runs[k];
          if (run.aside >= 0)
            set_window_aside(col, window(run), wbuf.get() + run.aside * col.count * 128);
          else if (run.r == 1)
            aside(run.i0);
        }
      }
#pragma omp parallel for schedule(static) if (M > kOrderedMoves)
      for (int64_t k = 0; k < R; ++k) {
        const ColumnRun& run = runs[k];
        if (k + kPrefetchPages < R && sp[runs[k + kPrefetchPages].i0] != sp[runs[k + kPrefetchPages - 1].i0])
          prefetch_half(X, sp[runs[k + kPrefetchPages].i0]);
        if (run.r == 1) {
          one(run.i0);
          continue;
        }
        const Window w = run.aside >= 0 ? Window{wbuf.get() + run.aside * col.count * 128,
                                                 wbuf.get() + run.aside * col.count * 128 + 64, 128}
                                        : window(run);
        move_columns(col, w, so, run.w0, run.i0, run.r, reinterpret_cast<char*>(X.base + xd[run.i0]),
                     col.stride * static_cast<int64_t>(sizeof(U)));
      }
      continue;
    }
#endif
    if (C > 0) {
#pragma omp parallel for schedule(static) if (C > 8192)
      for (int64_t i = 0; i < M; ++i) aside(i);
    }
    // rows of a contiguous D elements: the source row kPrefetchRows moves ahead asked for
    const bool flat_rows = X.flat_dims() && X.cs2 == 1;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(U));
#pragma omp parallel for schedule(static) if (M > kOrderedMoves)
    for (int64_t i = 0; i < M; ++i) {
      if (flat_rows && i + kPrefetchRows < M) {
        const char* a = reinterpret_cast<const char*>(X.base + xs[i + kPrefetchRows]);
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(a + o, 0, 3);
      }
      one(i);
    }
  }
}

void check_slots(const int64_t* p, const int64_t* o, int64_t M, int64_t pages, int64_t bs, const char* what) {
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < pages && o[i] >= 0 && o[i] < bs, what, " token ", i, " (page ", p[i],
                ", offset ", o[i], ") is outside the cache (", pages, " head-pages x ", bs, ")");
}

void compact(Tensor kc, Tensor vc, Tensor src_page, Tensor src_off, Tensor dst_page, Tensor dst_off) {
  check_cache_pair(kc, vc);
  const int64_t M = src_page.numel();
  TORCH_CHECK(src_off.numel() == M && dst_page.numel() == M && dst_off.numel() == M, "index lengths differ");
  if (M == 0) return;
  Tensor sp = as_long(src_page), so = as_long(src_off), dp = as_long(dst_page), dof = as_long(dst_off);
  const int64_t* a = sp.data_ptr<int64_t>();
  const int64_t* b = so.data_ptr<int64_t>();
  const int64_t* c = dp.data_ptr<int64_t>();
  const int64_t* d = dof.data_ptr<int64_t>();
  switch (kc.element_size()) {
    case 1: compact_kernel<uint8_t>(kc, vc, a, b, c, d, M); break;
    case 2: compact_kernel<uint16_t>(kc, vc, a, b, c, d, M); break;
    case 4: compact_kernel<uint32_t>(kc, vc, a, b, c, d, M); break;
    case 8: compact_kernel<uint64_t>(kc, vc, a, b, c, d, M); break;
    default: TORCH_CHECK(false, "compact: unsupported element size ", kc.element_size());
  }
}

// -------------------------------------------------------------------------------------- gather_pages
// Head-pages of a cache into contiguous [bs, D] rows in logical order (what scoring reads): page rows copied
// as they lie, key columns ([D, bs], vLLM's vec layouts) transposed, other packings element by element.
#if defined(__AVX512F__)
// 16 x 16 words of 4 bytes: src rows i (16 consecutive words each, ss words apart) -> dst rows (ds apart)
inline void transpose16_words(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m512i r[16], a[16], b[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 16; q += 4) {  // within each 128-bit lane: 4 x 4 blocks of rows q..q+3
    b[q] = _mm512_unpacklo_epi64(a[q], a[q + 2]);
    b[q + 1] = _mm512_unpackhi_epi64(a[q], a[q + 2]);
    b[q + 2] = _mm512_unpacklo_epi64(a[q + 1], a[q + 3]);
    b[q + 3] = _mm512_unpackhi_epi64(a[q + 1], a[q + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4k + j: lane k of b[j], b[4 + j], b[8 + j], b[12 + j]
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
    const __m512i d0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88),
                  d1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
    _mm512_storeu_si512(dst + (0 + j) * ds, _mm512_shuffle_i32x4(c0, d0, 0x88));
    _mm512_storeu_si512(dst + (4 + j) * ds, _mm512_shuffle_i32x4(c1, d1, 0x88));
    _mm512_storeu_si512(dst + (8 + j) * ds, _mm512_shuffle_i32x4(c0, d0, 0xDD));
    _mm512_storeu_si512(dst + (12 + j) * ds, _mm512_shuffle_i32x4(c1, d1, 0xDD));
  }
}
#endif

template <typename U>
void gather_kernel(const Cache<U>& X, const int64_t* ids, int64_t M, U* out) {
  const int64_t bs = X.bs, D = X.D;
  const bool rows = X.flat_dims() && X.cs2 == 1, columns = X.flat_dims() && X.ts2 == 1 && X.tg >= bs;
#pragma omp parallel for schedule(static) if (M * bs * D > (int64_t(1) << 16))
  for (int64_t m = 0; m < M; ++m) {
    const U* src = X.row(ids[m], 0);
    U* dst = out + m * bs * D;
    if (rows) {
      for (int64_t t = 0; t < bs; ++t) std::memcpy(dst + t * D, src + X.tok(t), D * sizeof(U));
    } else if (columns) {  // 16 x 16 tiles: a tile's 16 source lines stay in L1 while its rows are written
#if defined(__AVX512F__)
      if constexpr (sizeof(U) == 4) {
        if (bs % 16 == 0 && D % 16 == 0) {
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            for (int64_t t0 = 0; t0 < bs; t0 += 16)
              transpose16_words(reinterpret_cast<const uint32_t*>(src + d0 * X.cs2 + t0), X.cs2,
                                reinterpret_cast<uint32_t*>(dst + t0 * D + d0), D);
          continue;
        }
      }
#endif
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        for (int64_t t0 = 0; t0 < bs; t0 += 16) {
          const int64_t d1 = std::min(D, d0 + 16), t1 = std::min(bs, t0 + 16);
          for (int64_t t = t0; t < t1; ++t)
            for (int64_t d = d0; d < d1; ++d) dst[t * D + d] = src[d * X.cs2 + t];
        }
    } else {
      for (int64_t t = 0; t < bs; ++t)
        for (int64_t c = 0; c < D; ++c) dst[t * D + c] = src[X.tok(t) + (c / X.dg) * X.cs1 + (c % X.dg) * X.cs2];
    }
  }
}

// caches: one per layer (one layout, the same shape); ids [M] (every layer) or [L, M]; out [L, M, bs, D]
void gather_pages(at::TensorList caches, Tensor ids, Tensor out) {
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(L > 0, "gather_pages: no caches");
  const Tensor idx = as_long(ids);
  const int64_t M = idx.size(-1);
  TORCH_CHECK(idx.dim() == 1 || (idx.dim() == 2 && idx.size(0) == L), "gather_pages: ids must be [M] or [L, M]");
  const int64_t bs = cache_bs(caches[0]), D = cache_d(caches[0]), es = caches[0].element_size();
  TORCH_CHECK(out.is_contiguous() && out.dim() == 4 && out.size(0) == L && out.size(1) == M && out.size(2) == bs &&
                  out.size(3) == D && out.element_size() == es,
              "gather_pages: out must be a contiguous [L, M, bs, D] tensor of the caches' element size");
  const int64_t* ip = idx.data_ptr<int64_t>();
  {  // a large out is new memory: 2 MiB pages fault in ~500x less often than 4 KiB ones (advice only)
    const uintptr_t a = reinterpret_cast<uintptr_t>(out.data_ptr()), huge = uintptr_t(1) << 21;
    const uintptr_t lo = (a + huge - 1) & ~(huge - 1), hi = (a + out.numel() * es) & ~(huge - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
  for (int64_t l = 0; l < L; ++l) {
    const Tensor& c = caches[l];
    TORCH_CHECK(c.element_size() == es && cache_bs(c) == bs && cache_d(c) == D, "gather_pages: layer ", l,
                "'s cache differs from layer 0's");
    const int64_t pages = c.size(0) * c.size(1);
    const int64_t* li = ip + (idx.dim() == 2 ? l * M : 0);
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(li[m] >= 0 && li[m] < pages, "gather_pages: page id ", li[m], " (layer ", l, ", index ", m,
                  ") is outside the cache (", pages, " head-pages)");
    char* o = static_cast<char*>(out.data_ptr()) + l * M * bs * D * es;
    switch (es) {
      case 1: gather_kernel<uint8_t>(cache_view<uint8_t>(c), li, M, reinterpret_cast<uint8_t*>(o)); break;
      case 2: gather_kernel<uint16_t>(cache_view<uint16_t>(c), li, M, reinterpret_cast<uint16_t*>(o)); break;
      case 4: gather_kernel<uint32_t>(cache_view<uint32_t>(c), li, M, reinterpret_cast<uint32_t*>(o)); break;
      case 8: gather_kernel<uint64_t>(cache_view<uint64_t>(c), li, M, reinterpret_cast<uint64_t*>(o)); break;
      default: TORCH_CHECK(false, "gather_pages: unsupported element size ", es);
    }
  }
}

// -------------------------------------------------------------------------------- accumulate_moments
template <typename T>
void accumulate_kernel(const Tensor& kc, const Tensor& vc, const int64_t* page, const int64_t* off,
                       const int64_t* head, int64_t M, int64_t Hm, float* n, float* sk, float* sv, float* svk) {
  Cache<T> K = cache_view<T>(kc), V = cache_view<T>(vc);
  const int64_t D = K.D;
  // bucket the tokens by head (counting sort, stable)
  std::vector<int64_t> start(Hm + 1, 0), order(M);
  for (int64_t i = 0; i < M; ++i) ++start[head[i] + 1];
  for (int64_t h = 0; h < Hm; ++h) start[h + 1] += start[h];
  {
    std::vector<int64_t> pos(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < M; ++i) order[pos[head[i]]++] = i;
  }
  // tasks: (head, chunk of sum_vk rows); split rows only when there are fewer heads than threads
  const int64_t nt = omp_get_max_threads();
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((2 * nt + Hm - 1) / Hm, D / 8));
  if (nt == 1) chunks = 1;
  const int64_t rows = (D + chunks - 1) / chunks;
  constexpr int64_t NB = 32;  // tokens per batch
#pragma omp parallel
  {
    std::vector<float> kb(NB * D), vb(NB * D), vt(D * NB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < Hm * chunks; ++task) {
      const int64_t h = task / chunks, ch = task % chunks;
      const int64_t r0 = ch * rows, r1 = std::min(D, r0 + rows);
      if (r0 >= r1 || start[h] == start[h + 1]) continue;
      float* S = svk + h * D * D;
      for (int64_t b0 = start[h]; b0 < start[h + 1]; b0 += NB) {
        const int64_t nb = std::min(NB, start[h + 1] - b0);
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t i = order[b0 + j];
          load_dims(K, K.row(page[i], off[i]), kb.data() + j * D);
          load_dims(V, V.row(page[i], off[i]), vb.data() + j * D);
        }
        if (ch == 0) {
          n[h] += static_cast<float>(nb);
          for (int64_t j = 0; j < nb; ++j) {
            axpy(sk + h * D, 1.f, kb.data() + j * D, D);
            axpy(sv + h * D, 1.f, vb.data() + j * D, D);
          }
        }
        // transpose V so that the coefficients of a row are contiguous
        for (int64_t j = 0; j < nb; ++j)
          for (int64_t d = r0; d < r1; ++d) vt[d * NB + j] = vb[j * D + d];
        for (int64_t d = r0; d < r1; ++d) {
          float* row = S + d * D;
          const float* a = vt.data() + d * NB;
          int64_t j = 0;
          for (; j + 4 <= nb; j += 4) axpy4(row, a + j, kb.data() + j * D, D);
          for (; j < nb; ++j) axpy(row, a[j], kb.data() + j * D, D);
        }
      }
    }
  }
}

Tensor as_f32_contig(const Tensor& t, bool& copied) {
  TORCH_CHECK(t.device().is_cpu(), "moments must be CPU tensors");
  copied = !(t.scalar_type() == at::kFloat && t.is_contiguous());
  return copied ? t.to(at::kFloat).contiguous() : t;
}

void accumulate_moments(Tensor kc, Tensor vc, Tensor page_ids, Tensor offsets, Tensor head_of_token, Tensor n,
                        Tensor sum_k, Tensor sum_v, Tensor sum_vk) {
  check_cache_pair(kc, vc);
  const int64_t M = page_ids.numel(), D = cache_d(kc), Hm = n.numel();
  TORCH_CHECK(offsets.numel() == M && head_of_token.numel() == M, "index lengths differ");
  TORCH_CHECK(sum_k.numel() == Hm * D && sum_v.numel() == Hm * D && sum_vk.numel() == Hm * D * D,
              "moments must be n [H], sum_k [H, D], sum_v [H, D], sum_vk [H, D, D]");
  if (M == 0) return;
  Tensor p = as_long(page_ids), o = as_long(offsets), h = as_long(head_of_token);
  check_slots(p.data_ptr<int64_t>(), o.data_ptr<int64_t>(), M, kc.size(0) * kc.size(1), cache_bs(kc), "token");
  const int64_t* hp = h.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(hp[i] >= 0 && hp[i] < Hm, "head_of_token ", hp[i], " outside [0, ", Hm, ")");
  bool cn, ck, cv, cvk;
  Tensor n2 = as_f32_contig(n, cn), k2 = as_f32_contig(sum_k, ck), v2 = as_f32_contig(sum_v, cv),
         vk2 = as_f32_contig(sum_vk, cvk);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kc.scalar_type(), "accumulate_moments", [&] {
    accumulate_kernel<scalar_t>(kc, vc, p.data_ptr<int64_t>(), o.data_ptr<int64_t>(), hp, M, Hm,
                                n2.data_ptr<float>(), k2.data_ptr<float>(), v2.data_ptr<float>(),
                                vk2.data_ptr<float>());
  });
  if (cn) n.copy_(n2.view(n.sizes()));
  if (ck) sum_k.copy_(k2.view(sum_k.sizes()));
  if (cv) sum_v.copy_(v2.view(sum_v.sizes()));
  if (cvk) sum_vk.copy_(vk2.view(sum_vk.sizes()));
}

// -------------------------------------------------------------------------- ragged_decode_attention
// int32 or int64 index tensor of up to 3 dims, any strides (no conversion pass)
struct Idx {
  const void* p;
  bool i64;
  int64_t s0, s1, s2;
  explicit Idx(const Tensor& t) : p(t.data_ptr()), i64(t.scalar_type() == at::kLong) {
    TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "index tensors must be int32 or int64");
    s0 = t.dim() > 0 ? t.stride(0) : 0;
    s1 = t.dim() > 1 ? t.stride(1) : 0;
    s2 = t.dim() > 2 ? t.stride(2) : 0;
  }
  inline int64_t operator()(int64_t a, int64_t b = 0, int64_t c = 0) const {
    const int64_t o = a * s0 + b * s1 + c * s2;
    return i64 ? static_cast<const int64_t*>(p)[o] : static_cast<const int32_t*>(p)[o];
  }
};

template <typename T>
inline float load_scalar(const T* p) {
  return static_cast<float>(*p);
}

inline float log_add_exp(float a, float b) {
  const float m = std::max(a, b);
  if (m == kNegInf) return kNegInf;
  return m + std::log1p(std::exp(-std::fabs(a - b)));
}

// TQ: query and output element type (the cache type, or float)
template <typename T, typename TQ>
void decode_kernel(const TQ* q, int64_t qs0, int64_t qs1, int64_t qs2, Cache<T> K, Cache<T> V, int64_t D,
                   Idx pt, int64_t P, Idx sl, int64_t T_, int64_t H, int64_t G, float scale, const float* mn,
                   const float* msk, const float* msv, const float* msvk, TQ* out, float* lse) {
  const int64_t bs = K.bs;
  // key page stored [D, bs] (vLLM's CPU vec kernels): logits by columns
  const bool k_transposed = K.tg >= bs && K.ts2 == 1 && K.flat_dims() && K.cs2 != 1 && D > 1;
  // any other layout whose key rows are not contiguous (the AMX packing: 16-token groups, dims in pairs):
  // the page is unpacked into the same [D, bs] fp32 columns, walking it in its own order, then by columns
  const bool k_columns = k_transposed || (!(K.flat_dims() && K.cs2 == 1) && D > 1);
  const bool k_blocks = dense_blocks(K), v_pages = dense_blocks(V);
  bool pairs = false;
#ifdef CONTOUR_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>) pairs = pair_pages(K, V, D);
#endif
  bool vec = false;  // vLLM's vec layouts read straight from the page
#ifdef CONTOUR_VEC_PAGES
  vec = vec_pages(K, V, D);
#endif
#pragma omp parallel
  {
    // lg: the logits, then the softmax weights, of a chunk's tokens for each of the G queries (row stride ld)
    const int64_t cp = std::max<int64_t>(1, kChunkTokens / bs), ld = cp * bs;
    std::vector<float> qs(G * D), acc(G * D), kb(bs * D), vb(4 * D), lg(G * ld), m(G), l(G), tmp(D), ob(G * D),
        lb(G), blk(bs * D), vpage(v_pages ? bs * D : 0);
    // a bf16 query read as its own dim pairs by the pair path's dot products (no rounding of q * scale)
    constexpr bool qw_bf16 = std::is_same_v<TQ, c10::BFloat16>;
    std::vector<uint32_t> qw(qw_bf16 && pairs ? G * D / 2 : 0);
#ifdef CONTOUR_AMX
    const bool amx = qw_bf16 && pairs && G <= 16 && (D == 64 || D == 128) && amx_usable();
    if (amx) amx_configure(G, D);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t th = 0; th < T_ * H; ++th) {
      const int64_t t = th / H, h = th % H;
      const int64_t L = sl(t, h);
      const int64_t qrow = (t * H + h) * G;  // first query row of this KV head's group
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = load_scalar(q + t * qs0 + (h * G + g) * qs1 + d * qs2) * scale;
      if constexpr (qw_bf16) {
        for (int64_t g = 0; pairs && g < G; ++g)
          for (int64_t c = 0; c < D / 2; ++c) {
            const TQ* e = q + t * qs0 + (h * G + g) * qs1 + 2 * c * qs2;
            qw[g * (D / 2) + c] = uint32_t(e[0].x) | (uint32_t(e[qs2].x) << 16);
          }
#ifdef CONTOUR_AMX
        if (amx) amx_load_queries(qw.data(), D);
#endif
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t npages = L > 0 ? std::min<int64_t>(P, (L + bs - 1) / bs) : 0;
      // the row in chunks of cp pages, two passes each: the chunk's logits (row g of lg: its tokens, stride
      // ld), one softmax step over them (the accumulators rescaled once a chunk, not once a page), then the
      // values weighted by them. Pages are asked for ahead in the order they are read: the chunk's keys, its
      // values, the next chunk's keys.
      for (int64_t p0 = 0; p0 < npages; p0 += cp) {
        const int64_t pe = std::min(npages, p0 + cp);
        const int64_t len = std::min(L, pe * bs) - p0 * bs;
        for (int64_t p = p0; p < pe; ++p) {
          const int64_t page = pt(t, h, p);
          const int64_t n = std::min(bs, L - p * bs);
          float* lp = lg.data() + (p - p0) * bs;
          if (const int64_t a = p + kPrefetchPages; a < pe)
            prefetch_half(K, pt(t, h, a));
          else if (a - pe + p0 < pe)
            prefetch_half(V, pt(t, h, a - pe + p0));
          if (pairs) {
  #ifdef CONTOUR_PAIRS
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
  #ifdef CONTOUR_AMX
              if (amx) {
                for (int64_t u = 0; 32 * u < n; ++u) amx_logits32(K, page, u, scale, G, D, lp, ld);
              } else
  #endif
                pair_page_logits(K, page, n, qs.data(), qw_bf16 ? qw.data() : nullptr, scale, G, D, lp, ld);
            }
  #endif
            continue;
          }
  #ifdef CONTOUR_VEC_PAGES
          if (vec) {
            if constexpr (!std::is_same_v<T, double>) {
              vec_page_logits(K.row(page, 0), K.cs2, n, qs.data(), G, D, lp, ld);
              continue;
            }
          }
  #endif
          if (k_transposed) {  // key page stored [D, bs] (vLLM's CPU vec kernels): logits by columns
            const T* base = K.row(page, 0);
            for (int64_t d = 0; d < D; ++d) load_row(base + d * K.cs2, 1, n, kb.data() + d * bs);
          } else if (k_blocks) {
            unpack_page<true>(K, K.row(page, 0), n, kb.data(), bs, blk.data());
          } else if (k_columns) {  // two-level layout: token group t1, dim group c1, dim c2, tokens t2 (stride ts2)
            const T* base = K.row(page, 0);
            const int64_t tg = std::min(K.tg, bs), dg = K.flat_dims() ? D : K.dg;
            for (int64_t t1 = 0; t1 * tg < n; ++t1) {
              const int64_t nt = std::min(tg, n - t1 * tg);
              for (int64_t c1 = 0; c1 < D / dg; ++c1)
                for (int64_t c2 = 0; c2 < dg; ++c2)
                  load_row(base + t1 * K.ts1 + c1 * K.cs1 + c2 * K.cs2, K.ts2, nt,
                           kb.data() + (c1 * dg + c2) * bs + t1 * tg);
            }
          } else {
            for (int64_t j = 0; j < n; ++j) load_dims(K, K.row(page, j), kb.data() + j * D);
          }
          for (int64_t g = 0; g < G; ++g) {
            float* lgg = lp + g * ld;
            const float* qg = qs.data() + g * D;
            int64_t j = 0;
            if (k_columns) {
              std::fill(lgg, lgg + n, 0.f);
              int64_t d = 0;
              for (; d + 4 <= D; d += 4) axpy4(lgg, qg + d, kb.data() + d * bs, n, bs);
              for (; d < D; ++d) axpy(lgg, qg[d], kb.data() + d * bs, n);
            } else {
              for (; j + 4 <= n; j += 4) dot4(qg, kb.data() + j * D, D, lgg + j);
              for (; j < n; ++j) lgg[j] = dot(qg, kb.data() + j * D, D);
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* lgg = lg.data() + g * ld;
          const float mnew = std::max(m[g], row_max(lgg, len));
          if (mnew == kNegInf) continue;
          const float alpha = m[g] == kNegInf ? 0.f : std::exp(m[g] - mnew);
          if (alpha != 1.f) scal(acc.data() + g * D, alpha, D);
          l[g] = l[g] * alpha + exp_in_place(lgg, len, mnew);
          m[g] = mnew;
        }
        for (int64_t p = p0; p < pe; ++p) {
          const int64_t page = pt(t, h, p);
          const int64_t n = std::min(bs, L - p * bs);
          const float* lp = lg.data() + (p - p0) * bs;
          if (const int64_t a = p + kPrefetchPages; a < pe)
            prefetch_half(V, pt(t, h, a));
          else if (a < npages)
            prefetch_half(K, pt(t, h, a));
          int64_t j = 0;
          if (pairs) {
  #ifdef CONTOUR_PAIRS
            if constexpr (std::is_same_v<T, c10::BFloat16>) pair_page_values(V, page, n, lp, ld, G, D, acc.data());
  #endif
            continue;
          }
  #ifdef CONTOUR_VEC_PAGES
          if (vec) {
            if constexpr (!std::is_same_v<T, double>) {
              vec_page_values(V.row(page, 0), V.ts2, n, lp, ld, G, D, acc.data());
              continue;
            }
          }
  #endif
          if (v_pages) {  // the whole value page unpacked into rows once
            unpack_page<false>(V, V.row(page, 0), n, vpage.data(), D, blk.data());
            for (; j + 4 <= n; j += 4)
              for (int64_t g = 0; g < G; ++g) axpy4(acc.data() + g * D, lp + g * ld + j, vpage.data() + j * D, D);
            for (; j < n; ++j)
              for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, lp[g * ld + j], vpage.data() + j * D, D);
          }
          for (; j + 4 <= n; j += 4) {
            for (int64_t r = 0; r < 4; ++r) load_dims(V, V.row(page, j + r), vb.data() + r * D);
            for (int64_t g = 0; g < G; ++g) axpy4(acc.data() + g * D, lp + g * ld + j, vb.data(), D);
          }
          for (; j < n; ++j) {
            load_dims(V, V.row(page, j), vb.data());
            for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, lp[g * ld + j], vb.data(), D);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = ob.data() + g * D;
        const float* a = acc.data() + g * D;
        float lse_r = kNegInf;
        if (l[g] > 0.f) {
          const float inv = 1.f / l[g];
          for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
          lse_r = m[g] + std::log(l[g]);
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        }
        lb[g] = lse_r;
      }
      // evicted-part estimate (vllm_contour.moments.merge_evicted), fused
      const float cnt = mn != nullptr ? mn[th] : 0.f;
      if (cnt > 0.f) {
        const float* Sk = msk + th * D;
        const float* Sv = msv + th * D;
        const float* Svk = msvk + th * D * D;
        const float inv_n = 1.f / cnt, log_n = std::log(cnt);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs.data() + g * D;  // scaled query
          const float qsk = dot(qg, Sk, D);     // scale * q . sum_k
          const float log_ze = log_n + qsk * inv_n;
          // scale * S~ q = sum_vk (scale q) - sum_v (mu . scale q)
          for (int64_t d = 0; d < D; ++d) tmp[d] = dot(Svk + d * D, qg, D);
          float* o = ob.data() + g * D;
          const float lse_r = lb[g];
          const float w = lse_r == kNegInf ? 0.f : 1.f / (1.f + std::exp(log_ze - lse_r));
          const float mu_q = qsk * inv_n;
          for (int64_t d = 0; d < D; ++d) {
            const float fe = Sv[d] * inv_n + (tmp[d] - Sv[d] * mu_q) * inv_n;
            o[d] = w * o[d] + (1.f - w) * fe;
          }
          lb[g] = log_add_exp(lse_r, log_ze);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        TQ* o = out + (qrow + g) * D;
        const float* a = ob.data() + g * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<TQ>(a[d]);
        lse[qrow + g] = lb[g];
      }
    }
#ifdef CONTOUR_AMX
    if (amx) _tile_release();
#endif
  }
}

std::tuple<Tensor, Tensor> ragged_decode_attention(Tensor query, Tensor kc, Tensor vc, Tensor page_table, Tensor seq_lens,
                                            double scale, const std::optional<Tensor>& n,
                                            const std::optional<Tensor>& sum_k, const std::optional<Tensor>& sum_v,
                                            const std::optional<Tensor>& sum_vk) {
  check_cache_pair(kc, vc);
  TORCH_CHECK(query.dim() == 3, "query must be [T, Hq, D]");
  const int64_t T_ = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t H = kc.size(1);
  TORCH_CHECK(D == cache_d(kc), "query and cache head sizes differ");
  TORCH_CHECK(Hq % H == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(page_table.dim() == 3 && page_table.size(0) == T_ && page_table.size(1) == H,
              "page_table must be [T, H, P]");
  TORCH_CHECK(seq_lens.numel() == T_ * H, "seq_lens must be [T, H]");
  const int64_t P = page_table.size(2);
  const Tensor sl2 = seq_lens.dim() == 2 ? seq_lens : seq_lens.reshape({T_, H});  // keeps a copy alive
  const Idx pt(page_table), sl(sl2);
  {
    const int64_t pages = kc.size(0) * H, bs = cache_bs(kc);
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t L = sl(t, h);
        TORCH_CHECK(L <= P * bs, "seq_lens[", t, ", ", h, "] = ", L, " exceeds the page table (", P, " x ", bs, ")");
        const int64_t np = L > 0 ? (L + bs - 1) / bs : 0;
        for (int64_t j = 0; j < np; ++j) {
          const int64_t id = pt(t, h, j);
          TORCH_CHECK(id >= 0 && id < pages, "page id ", id, " outside the cache");
        }
      }
  }
  // the query is read in its own dtype when it matches the cache (else as fp32); the output has its dtype
  const bool same = query.scalar_type() == kc.scalar_type();
  const Tensor q = same ? query : query.to(at::kFloat);
  Tensor out = at::empty({T_, Hq, D}, q.options());
  Tensor lse = at::empty({T_, Hq}, q.options().dtype(at::kFloat));
  const bool has_m = n.has_value();
  Tensor mn, msk, msv, msvk;
  if (has_m) {
    TORCH_CHECK(sum_k.has_value() && sum_v.has_value() && sum_vk.has_value(), "moments need all four tensors");
    mn = n->to(at::kFloat).contiguous();
    msk = sum_k->to(at::kFloat).contiguous();
    msv = sum_v->to(at::kFloat).contiguous();
    msvk = sum_vk->to(at::kFloat).contiguous();
    TORCH_CHECK(mn.numel() == T_ * H && msk.numel() == T_ * H * D && msv.numel() == T_ * H * D &&
                    msvk.numel() == T_ * H * D * D,
                "moments must be n [T, H], sum_k/sum_v [T, H, D], sum_vk [T, H, D, D]");
  }
  const float* pm[4] = {has_m ? mn.data_ptr<float>() : nullptr, has_m ? msk.data_ptr<float>() : nullptr,
                        has_m ? msv.data_ptr<float>() : nullptr, has_m ? msvk.data_ptr<float>() : nullptr};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kc.scalar_type(), "ragged_decode_attention", [&] {
    if (same) {
      decode_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), q.stride(2),
                                        cache_view<scalar_t>(kc), cache_view<scalar_t>(vc), D, pt, P, sl, T_, H,
                                        Hq / H, static_cast<float>(scale), pm[0], pm[1], pm[2], pm[3],
                                        out.data_ptr<scalar_t>(), lse.data_ptr<float>());
    } else {
      decode_kernel<scalar_t, float>(q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
                                     cache_view<scalar_t>(kc), cache_view<scalar_t>(vc), D, pt, P, sl, T_, H,
                                     Hq / H, static_cast<float>(scale), pm[0], pm[1], pm[2], pm[3],
                                     out.data_ptr<float>(), lse.data_ptr<float>());
    }
  });
  return {same || query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type()), lse};
}

// How ragged_decode_attention reads vLLM's pages on this build and machine (for logs and benchmarks).
// layout "amx", bf16 pages in vLLM's AMX packing: "amx" (AMX tiles for the logits, AVX-512 for the values),
// "avx512_bf16", "avx512" (both from registers) or "generic" (pages unpacked to fp32 rows and columns);
// layout "vec", vLLM's vec layouts (keys [D, bs], value rows): "avx512" (read in place) or "generic".
std::string decode_path(const std::string& layout) {
  if (layout == "vec") {
#ifdef CONTOUR_VEC_PAGES
    return "avx512";
#else
    return "generic";
#endif
  }
  TORCH_CHECK(layout == "amx", "decode_path: layout must be 'amx' or 'vec', got '", layout, "'");
#ifdef CONTOUR_AMX
  if (amx_usable()) return "amx";
#endif
#if defined(CONTOUR_PAIRS) && defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(CONTOUR_PAIRS)
  return "avx512";
#else
  return "generic";
#endif
}

}  // namespace

TORCH_LIBRARY(vllm_contour, m) {
  m.def("compact(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor src_page, Tensor src_off, "
        "Tensor dst_page, Tensor dst_off) -> ()");
  m.def("accumulate_moments(Tensor key_cache, Tensor value_cache, Tensor page_ids, Tensor offsets, "
        "Tensor head_of_token, Tensor(a!) n, Tensor(b!) sum_k, Tensor(c!) sum_v, Tensor(d!) sum_vk) -> ()");
  m.def("ragged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor page_table, "
        "Tensor seq_lens, float scale, Tensor? n=None, Tensor? sum_k=None, Tensor? sum_v=None, "
        "Tensor? sum_vk=None) -> (Tensor, Tensor)");
  m.def("gather_pages(Tensor[] caches, Tensor ids, Tensor(a!) out) -> ()");
  m.def("decode_path(str layout=\"amx\") -> str", &decode_path);
}

TORCH_LIBRARY_IMPL(vllm_contour, CPU, m) {
  m.impl("compact", &compact);
  m.impl("accumulate_moments", &accumulate_moments);
  m.impl("ragged_decode_attention", &ragged_decode_attention);
  m.impl("gather_pages", &gather_pages);
}

// An (empty) Python module, so that `import vllm_contour._C` loads the library and runs the registrations.
#define CONTOUR_CAT_(a, b) a##b
#define CONTOUR_CAT(a, b) CONTOUR_CAT_(a, b)
extern "C" PyMODINIT_FUNC CONTOUR_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "vllm-contour CPU kernels: torch.ops.vllm_contour.*",
                                   -1, nullptr};
  return PyModule_Create(&def);
}
