// Shared by the op front end (contour_ops.cpp) and the kernels of each ISA level (isa_*.cpp, one file per
// level, each compiling kernels.inc for its instructions).
//
// The whole extension is compiled for a portable baseline (setup.py: -march=x86-64-v2); each isa_*.cpp turns
// its instructions on after the headers with `#pragma GCC target`, so only the kernels defined there use them
// (every header's inline function and template stays baseline code: no AVX-512 copy of a shared function can
// stand in for the baseline one). contour_ops.cpp picks a level at run time from what the CPU (and, for AMX,
// Linux) allows:
//
//   generic      x86-64-v2 (SSE4.2): the kernels' plain C++ loops
//   avx2         x86-64-v3 (AVX2, FMA, F16C): the same loops in 256-bit vectors, fp16 rows through F16C
//   avx512       x86-64-v4 (AVX-512 F/BW/VL/DQ/CD): bf16 pair pages and vLLM's vec pages read in registers,
//                fast softmax, column / half-word moves in compaction, 16x16 transposes in gather_pages
//   avx512_bf16  + AVX512_BF16: a bf16 query's logits on bf16 pair pages from VDPBF16PS
//   amx          + AMX-TILE, AMX-BF16 (and Linux's permission for the tile data): those logits from TDPBF16PS
//
// Only decode of a bf16 query on a bf16 cache differs above avx512: the avx512_bf16 file compiles just that
// (its AMX helpers are functions of their own, target("amx-tile,amx-bf16")); every other op and dtype runs
// the avx512 kernels at those levels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

// every intrinsic is declared whatever the compile flags (GCC); a function may use those its target allows
#include <immintrin.h>

#if defined(__clang__) || !defined(__GNUC__)
#error "vllm-contour's CPU kernels need GCC (per-file #pragma GCC target for each ISA level)"
#endif

#define CONTOUR_HIDDEN __attribute__((visibility("hidden")))

namespace contour {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------------ views
// One byte of an fp8 cache (vLLM's CPU fp8 pages are uint8): it reads as a number only through its cache's
// table (Cache::lut, 256 fp32 values: vLLM's reading of each byte times the layer's k_scale or v_scale).
struct Fp8 {
  uint8_t x;
};

// Element (page, token t, dim c) at base + block*s0 + lane*s1 + tok(t) + dim(c), with
// tok(t) = (t / tg) * ts1 + (t % tg) * ts2 and dim(c) = (c / dg) * cs1 + (c % dg) * cs2.
// Strides count elements; Cache<void> is the untyped form passed from the front end to the kernels.
template <typename T>
struct Cache {
  T* base;
  int64_t s0, s1, heads, pages, bs, D;
  int64_t tg, ts1, ts2, dg, cs1, cs2;
  const float* lut = nullptr;  // Fp8 caches: the dequantised value of each byte (scale included)
  inline int64_t tok(int64_t off) const { return tg >= bs ? off * ts2 : (off / tg) * ts1 + (off % tg) * ts2; }
  inline T* row(int64_t page, int64_t off) const {
    return base + (page / heads) * s0 + (page % heads) * s1 + tok(off);
  }
  inline bool flat_dims() const { return dg >= D; }  // one stride (cs2) between a row's elements
};
using RawCache = Cache<void>;

template <typename T>
inline Cache<T> typed(const RawCache& c) {
  return {static_cast<T*>(c.base), c.s0, c.s1, c.heads, c.pages, c.bs, c.D, c.tg, c.ts1, c.ts2, c.dg, c.cs1, c.cs2,
          c.lut};
}

// int32 or int64 index tensor of up to 3 dims, any strides (no conversion pass)
struct Idx {
  const void* p;
  bool i64;
  int64_t s0, s1, s2;
  inline int64_t operator()(int64_t a, int64_t b = 0, int64_t c = 0) const {
    const int64_t o = a * s0 + b * s1 + c * s2;
    return i64 ? static_cast<const int64_t*>(p)[o] : static_cast<const int32_t*>(p)[o];
  }
};

enum class Dtype : int { f64, f32, f16, bf16, fp8 };  // fp8: bytes read through the cache's table

// ragged_decode_attention's kernel arguments (checked by the front end)
struct DecodeArgs {
  Dtype cache;   // key / value element type
  bool q_same;   // the query and output in the cache's type (else fp32; for fp8 caches: in query_type)
  Dtype query_type;  // fp8 caches: the query's and output's type (fp32, bf16 or fp16)
  const void* q;
  int64_t qs0, qs1, qs2;
  RawCache K, V;
  int64_t D;
  Idx pt;
  int64_t P;
  Idx sl;
  int64_t T, H, G;
  float scale;
  const float *mn, *msk, *msv, *msvk;  // fused moments (nullptr: none)
  void* out;
  float* lse;
  bool amx;  // AMX tiles for a bf16 query's logits where the pair path can (only the avx512_bf16 kernels)
};

// One ISA level's kernels. decode returns false for what it does not compile (the avx512_bf16 file: all but
// a bf16 query on a bf16 cache); compact, gather, gather_lut and accumulate are nullptr there.
struct Kernels {
  const char* name;    // the file's level
  const char* target;  // its #pragma GCC target ("" for the baseline)
  void (*compact)(const RawCache& K, const RawCache& V, int64_t elem_size, const int64_t* sp, const int64_t* so,
                  const int64_t* dp, const int64_t* dof, int64_t M);
  void (*gather)(const RawCache& X, int64_t elem_size, const int64_t* ids, int64_t M, void* out);
  // fp8 pages dequantised through X.lut into fp32 [M, bs, D] rows
  void (*gather_lut)(const RawCache& X, const int64_t* ids, int64_t M, float* out);
  void (*accumulate)(Dtype dt, const RawCache& K, const RawCache& V, const int64_t* page, const int64_t* off,
                     const int64_t* head, int64_t M, int64_t Hm, float* n, float* sk, float* sv, float* svk);
  bool (*decode)(const DecodeArgs& a);
};

CONTOUR_HIDDEN const Kernels& kernels_generic();
CONTOUR_HIDDEN const Kernels& kernels_avx2();
CONTOUR_HIDDEN const Kernels& kernels_avx512();
CONTOUR_HIDDEN const Kernels& kernels_avx512_bf16();

}  // namespace contour
