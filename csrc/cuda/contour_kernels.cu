// Raw-pointer CUDA versions of vllm-contour's three ops (no torch headers: torch 2.13.0+cpu cannot link a
// torch CUDA extension; a CUDA build binds these launchers from a .cpp). Compile-checked in the test suite
// with `nvcc -c -arch=sm_90`. The Triton kernels (triton_ops/) are what the dispatch uses on GPU today.
//
// Cache convention: key/value caches are [num_blocks, H, bs, D] with arbitrary element strides
// (s0, s1, s2, s3); a head-page id is block * H + lane. bf16 / fp16 / fp32 caches, fp32 arithmetic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace contour {

struct CacheDesc {
  const void* base;  // element type per kernel template
  int64_t s0, s1, s2, s3;
  int64_t heads;
};

__device__ __forceinline__ int64_t row_offset(const CacheDesc& c, int64_t page, int64_t off) {
  return (page / c.heads) * c.s0 + (page % c.heads) * c.s1 + off * c.s2;
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// ------------------------------------------------------------------------------------------ compact
// Bits are moved as U (uint16_t for bf16/fp16, uint32_t for fp32). Two launches on one stream: gather every
// source row into tmp [2, M, D], then scatter (sources and destinations may overlap).
template <typename U>
__global__ void compact_gather_kernel(CacheDesc k, CacheDesc v, U* __restrict__ tmp, const int64_t* __restrict__ page,
                                      const int64_t* __restrict__ off, int64_t M, int64_t D) {
  const int64_t i = blockIdx.x;
  if (i >= M) return;
  const int64_t ko = row_offset(k, page[i], off[i]);
  const int64_t vo = row_offset(v, page[i], off[i]);
  const U* kb = static_cast<const U*>(k.base);
  const U* vb = static_cast<const U*>(v.base);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    tmp[i * D + d] = kb[ko + d * k.s3];
    tmp[(M + i) * D + d] = vb[vo + d * v.s3];
  }
}

template <typename U>
__global__ void compact_scatter_kernel(CacheDesc k, CacheDesc v, const U* __restrict__ tmp,
                                       const int64_t* __restrict__ page, const int64_t* __restrict__ off, int64_t M,
                                       int64_t D) {
  const int64_t i = blockIdx.x;
  if (i >= M) return;
  const int64_t ko = row_offset(k, page[i], off[i]);
  const int64_t vo = row_offset(v, page[i], off[i]);
  U* kb = const_cast<U*>(static_cast<const U*>(k.base));
  U* vb = const_cast<U*>(static_cast<const U*>(v.base));
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    kb[ko + d * k.s3] = tmp[i * D + d];
    vb[vo + d * v.s3] = tmp[(M + i) * D + d];
  }
}

// ------------------------------------------------------------------------------- accumulate_moments
// Block (token chunk c): for each token of the chunk (any head), thread t owns entries t, t + blockDim, ...
// of the head's [D, D] sum_vk and adds v[d] * k[e] with fp32 atomics; K and V rows staged in shared memory.
template <typename T>
__global__ void accumulate_moments_kernel(CacheDesc k, CacheDesc v, const int64_t* __restrict__ page,
                                          const int64_t* __restrict__ off, const int64_t* __restrict__ head,
                                          int64_t M, int64_t D, float* __restrict__ n, float* __restrict__ sum_k,
                                          float* __restrict__ sum_v, float* __restrict__ sum_vk, int chunk) {
  extern __shared__ float sh[];  // [2, D]
  float* ks = sh;
  float* vs = sh + D;
  const T* kb = static_cast<const T*>(k.base);
  const T* vb = static_cast<const T*>(v.base);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * chunk;
  for (int64_t i = i0; i < M && i < i0 + chunk; ++i) {
    const int64_t h = head[i];
    const int64_t ko = row_offset(k, page[i], off[i]);
    const int64_t vo = row_offset(v, page[i], off[i]);
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      ks[d] = to_f(kb[ko + d * k.s3]);
      vs[d] = to_f(vb[vo + d * v.s3]);
      atomicAdd(sum_k + h * D + d, ks[d]);
      atomicAdd(sum_v + h * D + d, vs[d]);
    }
    if (threadIdx.x == 0) atomicAdd(n + h, 1.f);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < D * D; e += blockDim.x)
      atomicAdd(sum_vk + h * D * D + e, vs[e / D] * ks[e % D]);
  }
}

// ------------------------------------------------------------------------- ragged_decode_attention
// Block (t, h), WARPS warps: warp w takes tokens w, w + WARPS, ...; lane l holds dims l, l + 32, ... of D
// (D <= 32 * DPL). Each warp keeps an online softmax per query head of the group (G <= MAX_G); the warps
// are merged through shared memory at the end. Optional fused moments (vllm_contour.moments.merge_evicted).
constexpr int WARPS = 4;
constexpr int MAX_G = 8;
constexpr int DPL = 8;  // dims per lane: D <= 256

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T, typename TQ>
__global__ void __launch_bounds__(WARPS * 32)
    ragged_decode_kernel(const TQ* __restrict__ q, int64_t qs0, int64_t qs1, int64_t qs2, CacheDesc k, CacheDesc v,
                         const int32_t* __restrict__ page_table, int64_t pts0, int64_t pts1, int64_t pts2,
                         const int32_t* __restrict__ seq_lens, int64_t sls0, int64_t sls1, int64_t H, int64_t G,
                         int64_t D, int64_t bs, float scale, float* __restrict__ out, float* __restrict__ lse,
                         const float* __restrict__ mom_n, const float* __restrict__ mom_k,
                         const float* __restrict__ mom_v, const float* __restrict__ mom_vk) {
  const int64_t th = blockIdx.x;
  const int64_t t = th / H, h = th % H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t L = seq_lens[t * sls0 + h * sls1];
  const T* kb = static_cast<const T*>(k.base);
  const T* vb = static_cast<const T*>(v.base);

  float qr[MAX_G][DPL], acc[MAX_G][DPL], m[MAX_G], l[MAX_G];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int64_t d = lane + 32 * j;
      qr[g][j] = (g < G && d < D) ? to_f(q[t * qs0 + (h * G + g) * qs1 + d * qs2]) * scale : 0.f;
      acc[g][j] = 0.f;
    }
  }
  for (int64_t i = warp; i < L; i += WARPS) {
    const int64_t pg = page_table[t * pts0 + h * pts1 + (i / bs) * pts2];
    const int64_t ko = row_offset(k, pg, i % bs);
    const int64_t vo = row_offset(v, pg, i % bs);
    float kr[DPL], vr[DPL];
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int64_t d = lane + 32 * j;
      kr[j] = d < D ? to_f(kb[ko + d * k.s3]) : 0.f;
      vr[j] = d < D ? to_f(vb[vo + d * v.s3]) : 0.f;
    }
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g >= G) break;
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < DPL; ++j) s += qr[g][j] * kr[j];
      s = warp_sum(s);
      const float mn = fmaxf(m[g], s);
      const float a = __expf(m[g] - mn);  // m = -inf -> 0
      const float p = __expf(s - mn);
      l[g] = l[g] * a + p;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[g][j] = acc[g][j] * a + p * vr[j];
      m[g] = mn;
    }
  }
  // merge the warps: shared [WARPS][MAX_G] (m, l) and [WARPS][MAX_G][D] acc
  extern __shared__ float sh[];
  float* sm = sh;
  float* sl = sm + WARPS * MAX_G;
  float* sa = sl + WARPS * MAX_G;
  for (int g = 0; g < G && g < MAX_G; ++g) {
    if (lane == 0) {
      sm[warp * MAX_G + g] = m[g];
      sl[warp * MAX_G + g] = l[g];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < D) sa[(warp * MAX_G + g) * D + d] = acc[g][j];
    }
  }
  __syncthreads();
  // thread x handles (g, d) pairs
  for (int64_t x = threadIdx.x; x < G * D; x += blockDim.x) {
    const int64_t g = x / D, d = x % D;
    float mx = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm[w * MAX_G + g]);
    float ls = 0.f, a = 0.f;
    if (mx != -INFINITY) {
      for (int w = 0; w < WARPS; ++w) {
        const float f = __expf(sm[w * MAX_G + g] - mx);
        ls += sl[w * MAX_G + g] * f;
        a += sa[(w * MAX_G + g) * D + d] * f;
      }
    }
    float o = ls > 0.f ? a / ls : 0.f;
    float lr = ls > 0.f ? mx + logf(ls) : -INFINITY;
    if (mom_n != nullptr && mom_n[th] > 0.f) {
      const float cnt = mom_n[th];
      const float* Sk = mom_k + th * D;
      const float* Sv = mom_v + th * D;
      const float* Svk = mom_vk + th * D * D;
      float qsk = 0.f, sq = 0.f;
      for (int64_t e = 0; e < D; ++e) {
        const float qe = to_f(q[t * qs0 + (h * G + g) * qs1 + e * qs2]) * scale;
        qsk += qe * Sk[e];
        sq += Svk[d * D + e] * qe;
      }
      const float mu_q = qsk / cnt;
      const float log_ze = logf(cnt) + mu_q;
      const float fe = (Sv[d] + sq - Sv[d] * mu_q) / cnt;
      const float w = ls > 0.f ? 1.f / (1.f + __expf(log_ze - lr)) : 0.f;
      o = w * o + (1.f - w) * fe;
      const float hi = fmaxf(lr, log_ze);
      lr = hi + log1pf(__expf(-fabsf(lr - log_ze)));
      if (!(ls > 0.f)) lr = log_ze;
    }
    out[(th * G + g) * D + d] = o;
    if (d == 0) lse[th * G + g] = lr;
  }
}

}  // namespace contour

// ------------------------------------------------------------------------------------------ launchers
// dtype codes: 0 = fp32, 1 = bf16, 2 = fp16. Return the cudaError_t of the launch.
using contour::CacheDesc;

extern "C" int contour_compact(CacheDesc k, CacheDesc v, int elem_bytes, void* tmp, const int64_t* src_page,
                               const int64_t* src_off, const int64_t* dst_page, const int64_t* dst_off, int64_t M,
                               int64_t D, cudaStream_t stream) {
  if (M == 0) return 0;
  const int threads = D >= 128 ? 128 : 64;
  if (elem_bytes == 2) {
    contour::compact_gather_kernel<uint16_t><<<M, threads, 0, stream>>>(k, v, static_cast<uint16_t*>(tmp), src_page,
                                                                        src_off, M, D);
    contour::compact_scatter_kernel<uint16_t><<<M, threads, 0, stream>>>(k, v, static_cast<uint16_t*>(tmp),
                                                                         dst_page, dst_off, M, D);
  } else if (elem_bytes == 4) {
    contour::compact_gather_kernel<uint32_t><<<M, threads, 0, stream>>>(k, v, static_cast<uint32_t*>(tmp), src_page,
                                                                        src_off, M, D);
    contour::compact_scatter_kernel<uint32_t><<<M, threads, 0, stream>>>(k, v, static_cast<uint32_t*>(tmp),
                                                                         dst_page, dst_off, M, D);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int contour_accumulate_moments(CacheDesc k, CacheDesc v, int dtype, const int64_t* page,
                                          const int64_t* off, const int64_t* head, int64_t M, int64_t D, float* n,
                                          float* sum_k, float* sum_v, float* sum_vk, cudaStream_t stream) {
  if (M == 0) return 0;
  const int chunk = 16;
  const int blocks = static_cast<int>((M + chunk - 1) / chunk);
  const size_t shmem = 2 * D * sizeof(float);
  switch (dtype) {
    case 0: contour::accumulate_moments_kernel<float><<<blocks, 256, shmem, stream>>>(
                k, v, page, off, head, M, D, n, sum_k, sum_v, sum_vk, chunk); break;
    case 1: contour::accumulate_moments_kernel<__nv_bfloat16><<<blocks, 256, shmem, stream>>>(
                k, v, page, off, head, M, D, n, sum_k, sum_v, sum_vk, chunk); break;
    case 2: contour::accumulate_moments_kernel<__half><<<blocks, 256, shmem, stream>>>(
                k, v, page, off, head, M, D, n, sum_k, sum_v, sum_vk, chunk); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

// query in the cache dtype; out [T, Hq, D] / lse [T, Hq] fp32 contiguous; moments contiguous fp32 or null.
extern "C" int contour_ragged_decode_attention(const void* q, int64_t qs0, int64_t qs1, int64_t qs2, CacheDesc k,
                                               CacheDesc v, int dtype, const int32_t* page_table, int64_t pts0,
                                               int64_t pts1, int64_t pts2, const int32_t* seq_lens, int64_t sls0,
                                               int64_t sls1, int64_t T, int64_t H, int64_t G, int64_t D,
                                               int64_t bs, float scale, float* out, float* lse,
                                               const float* mom_n, const float* mom_k, const float* mom_v,
                                               const float* mom_vk, cudaStream_t stream) {
  if (G > contour::MAX_G || D > 32 * contour::DPL) return static_cast<int>(cudaErrorInvalidValue);
  if (T * H == 0) return 0;
  const size_t shmem = (2 * contour::WARPS * contour::MAX_G + contour::WARPS * contour::MAX_G * D) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(T * H)), block(contour::WARPS * 32);
#define CONTOUR_DECODE(TT)                                                                                       \
  contour::ragged_decode_kernel<TT, TT><<<grid, block, shmem, stream>>>(                                         \
      static_cast<const TT*>(q), qs0, qs1, qs2, k, v, page_table, pts0, pts1, pts2, seq_lens, sls0, sls1, H, G, D, \
      bs, scale, out, lse, mom_n, mom_k, mom_v, mom_vk)
  switch (dtype) {
    case 0: CONTOUR_DECODE(float); break;
    case 1: CONTOUR_DECODE(__nv_bfloat16); break;
    case 2: CONTOUR_DECODE(__half); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
#undef CONTOUR_DECODE
  return static_cast<int>(cudaGetLastError());
}
