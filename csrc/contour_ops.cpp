// CPU kernels of vllm-contour's ops (C++/OpenMP): the op front end. Caches fp32 / bf16 / fp16, or fp8 bytes
// (uint8) read through a 256-entry fp32 table per side (k_lut / v_lut, luts: vLLM's reading of each byte times
// the layer's scale; vllm_contour/ops/fp8.py); compaction copies the bits of any 1/2/4/8-byte dtype; all
// arithmetic in fp32.
//
// Cache convention (see vllm_contour/ops/reference.py): key_cache / value_cache are [num_blocks, H, bs, D]
// views with arbitrary element strides, or the two-level [num_blocks, H, bs/tg, tg, D/dg, dg] form of packed
// page layouts (vLLM's AMX pages; vllm_contour/ops/cpu_layout.py): token t = t1*tg + t2, dim c = c1*dg + c2.
// Both are read through one description (contour::Cache); a head-page id is block * H + lane.
//
//   compact(kc, vc, src_page, src_off, dst_page, dst_off)          in place, overlap-safe
//   accumulate_moments(kc, vc, page_ids, offsets, head, n, sum_k, sum_v, sum_vk, [k_lut, v_lut])
//                                                                   in place, fp32 stats
//   ragged_decode_attention(q, kc, vc, page_table, seq_lens, scale, [n, sum_k, sum_v, sum_vk], [k_lut, v_lut])
//                                                                   -> (out, lse)
//   gather_pages([cache per layer], ids, out)                       head-pages into [L, M, bs, D] rows
//   gather_pages_lut([fp8 cache per layer], ids, luts, out)         the same dequantised into fp32 rows
//
// The kernels (kernels.inc) are compiled once per ISA level (isa_*.cpp: generic, avx2, avx512, avx512_bf16
// with the amx level's helpers; contour.h); this file checks the arguments and runs the kernels of the
// current level:
//   cpu_isa() -> str                 the level the ops run at: the best this CPU (and Linux, for AMX) allows,
//                                    at most VLLM_CONTOUR_CPU_ISA=<level> (VLLM_CONTOUR_NO_AMX=1: avx512_bf16)
//   set_cpu_isa(str isa) -> str      run at that level from now on ("auto": the default again); fails where the
//                                    CPU lacks its instructions; returns the level it replaces
//   cpu_isas() -> str[]              every level compiled into this module
//   cpu_isa_missing(str isa) -> str  what this CPU lacks for that level ("" if nothing)
//   cpu_baseline() -> str            the ISA the code outside the levels was compiled for (x86-64-v2 by default)
//   decode_path(str layout) -> str   how decode reads vLLM's pages at the current level (logs, benchmarks)
// Light headers only; the ops are registered with the dispatcher (torch.ops.vllm_contour.*), the Python
// module itself is empty.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <Python.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "contour.h"

namespace contour {
namespace {

using at::Tensor;

// ------------------------------------------------------------------------------------------ ISA levels
enum Level : int { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAmx, kNumLevels };
constexpr const char* kLevelNames[kNumLevels] = {"generic", "avx2", "avx512", "avx512_bf16", "amx"};

std::string level_list() {
  std::string s;
  for (int l = 0; l < kNumLevels; ++l) s += std::string(l ? ", " : "") + kLevelNames[l];
  return s;
}

int level_of(const std::string& name) {
  for (int l = 0; l < kNumLevels; ++l)
    if (name == kLevelNames[l]) return l;
  TORCH_CHECK(false, "unknown CPU ISA level '", name, "' (one of: ", level_list(), ")");
}

// Linux keeps the AMX tile data off until a process asks for it (once; as vLLM's worker does)
bool amx_permission() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kXtiledata = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The instructions (as GCC's __builtin_cpu_supports names them, which also checks that the OS saves their
// registers) this CPU lacks for a level: "" when it has them all. What each level compiles for: isa_*.cpp.
std::string missing_features(int level) {
  __builtin_cpu_init();
  std::string m;
  auto need = [&m](bool ok, const char* name) {
    if (!ok) m += std::string(m.empty() ? "" : " ") + name;
  };
  if (level >= kAvx2) {
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("fma"), "fma");
    need(__builtin_cpu_supports("f16c"), "f16c");
    need(__builtin_cpu_supports("bmi"), "bmi");
    need(__builtin_cpu_supports("bmi2"), "bmi2");
    need(__builtin_cpu_supports("lzcnt"), "lzcnt");
    need(__builtin_cpu_supports("movbe"), "movbe");
  }
  if (level >= kAvx512) {
    need(__builtin_cpu_supports("avx512f"), "avx512f");
    need(__builtin_cpu_supports("avx512bw"), "avx512bw");
    need(__builtin_cpu_supports("avx512vl"), "avx512vl");
    need(__builtin_cpu_supports("avx512dq"), "avx512dq");
    need(__builtin_cpu_supports("avx512cd"), "avx512cd");
  }
  if (level >= kAvx512Bf16) need(__builtin_cpu_supports("avx512bf16"), "avx512bf16");
  if (level >= kAmx) {
    need(__builtin_cpu_supports("amx-tile"), "amx-tile");
    need(__builtin_cpu_supports("amx-bf16"), "amx-bf16");
    if (m.empty() && !amx_permission())
      m = "amx-tile data (Linux refused arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))";
  }
  return m;
}

// The default level: the best the CPU allows, at most VLLM_CONTOUR_CPU_ISA (a level name, or "auto"/"");
// VLLM_CONTOUR_NO_AMX=1 caps it at avx512_bf16. Read at the first op and at set_cpu_isa("auto"); AMX
// permission is asked for only when the cap allows AMX.
int default_level() {
  int cap = kAmx;
  const char* no_amx = std::getenv("VLLM_CONTOUR_NO_AMX");
  if (no_amx != nullptr && std::strcmp(no_amx, "1") == 0) cap = kAvx512Bf16;
  const char* want = std::getenv("VLLM_CONTOUR_CPU_ISA");
  if (want != nullptr && *want != '\0' && std::strcmp(want, "auto") != 0) cap = std::min(cap, level_of(want));
  for (int l = cap; l > kGeneric; --l)
    if (missing_features(l).empty()) return l;
  return kGeneric;
}

std::atomic<int> g_level{-1};

int level() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l < 0) {
    l = default_level();
    g_level.store(l, std::memory_order_relaxed);
  }
  return l;
}

// compaction, gathers and moments: the same kernels at avx512 and above
const Kernels& base_kernels(int l) {
  switch (std::min(l, static_cast<int>(kAvx512))) {
    case kGeneric: return kernels_generic();
    case kAvx2: return kernels_avx2();
    default: return kernels_avx512();
  }
}

std::string cpu_isa() { return kLevelNames[level()]; }

std::string set_cpu_isa(const std::string& isa) {
  const int before = level();
  if (isa.empty() || isa == "auto") {
    g_level.store(default_level(), std::memory_order_relaxed);
  } else {
    const int l = level_of(isa);
    const std::string missing = missing_features(l);
    TORCH_CHECK(missing.empty(), "CPU ISA level '", isa, "' needs what this CPU lacks: ", missing);
    g_level.store(l, std::memory_order_relaxed);
  }
  return kLevelNames[before];
}

std::vector<std::string> cpu_isas() {
  // each level's kernels name themselves; the amx level is the avx512_bf16 kernels with their AMX helpers
  std::vector<std::string> out;
  for (const Kernels* k : {&kernels_generic(), &kernels_avx2(), &kernels_avx512(), &kernels_avx512_bf16()})
    out.emplace_back(k->name);
  out.emplace_back(kLevelNames[kAmx]);
  return out;
}

std::string cpu_isa_missing(const std::string& isa) { return missing_features(level_of(isa)); }

std::string cpu_baseline() {  // the compile flags' ISA (setup.py), from GCC's predefined macros
#if defined(__AVX512F__)
  return "x86-64-v4";
#elif defined(__AVX2__)
  return "x86-64-v3";
#elif defined(__SSE4_2__) && defined(__POPCNT__)
  return "x86-64-v2";
#else
  return "x86-64";
#endif
}

// How ragged_decode_attention reads vLLM's pages at the current level (for logs and benchmarks).
// layout "amx", bf16 pages in vLLM's AMX packing: "amx" (AMX tiles for the logits, AVX-512 for the values),
// "avx512_bf16", "avx512" (both from registers), "avx2" or "generic" (pages unpacked to fp32 rows and
// columns, the loops in AVX2 or baseline vectors); layout "vec", vLLM's vec layouts (keys [D, bs], value
// rows): "avx512" (read in place), "avx2" or "generic".
std::string decode_path(const std::string& layout) {
  const int l = level();
  if (layout == "vec") return kLevelNames[std::min(l, static_cast<int>(kAvx512))];
  TORCH_CHECK(layout == "amx", "decode_path: layout must be 'amx' or 'vec', got '", layout, "'");
  return kLevelNames[l];
}

// ------------------------------------------------------------------------------------------- arguments
inline int64_t cache_bs(const Tensor& c) { return c.dim() == 4 ? c.size(2) : c.size(2) * c.size(3); }
inline int64_t cache_d(const Tensor& c) { return c.dim() == 4 ? c.size(3) : c.size(4) * c.size(5); }

RawCache cache_view(const Tensor& c) {
  RawCache x{c.data_ptr(), c.stride(0), c.stride(1), c.size(1), c.size(0) * c.size(1), cache_bs(c), cache_d(c),
             0, 0, 0, 0, 0, 0};
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

// the floating types the kernels read (AT_DISPATCH_FLOATING_TYPES_AND2(kBFloat16, kHalf)'s), and fp8 bytes
Dtype dtype_of(at::ScalarType s, const char* op) {
  switch (s) {
    case at::kDouble: return Dtype::f64;
    case at::kFloat: return Dtype::f32;
    case at::kHalf: return Dtype::f16;
    case at::kBFloat16: return Dtype::bf16;
    case at::kByte: return Dtype::fp8;
    default: TORCH_CHECK(false, '"', op, "\" not implemented for '", c10::toString(s), "'");
  }
}

// An fp8 cache (uint8) reads through its table: [256] fp32, contiguous; other caches take none
const float* lut_of(const Tensor& cache, const std::optional<Tensor>& lut, const char* op, const char* side) {
  if (cache.scalar_type() != at::kByte) {
    TORCH_CHECK(!lut.has_value(), op, ": ", side, " is only for fp8 (uint8) caches");
    return nullptr;
  }
  TORCH_CHECK(lut.has_value(), op, ": an fp8 (uint8) cache needs its ", side, " (256 fp32 values)");
  TORCH_CHECK(lut->scalar_type() == at::kFloat && lut->is_contiguous() && lut->numel() == 256 &&
                  lut->device().is_cpu(),
              op, ": ", side, " must be a contiguous CPU fp32 tensor of 256 values");
  return lut->data_ptr<float>();
}

Tensor as_long(const Tensor& t) { return t.to(at::kLong).contiguous(); }

Idx index_of(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "index tensors must be int32 or int64");
  return {t.data_ptr(), t.scalar_type() == at::kLong, t.dim() > 0 ? t.stride(0) : 0, t.dim() > 1 ? t.stride(1) : 0,
          t.dim() > 2 ? t.stride(2) : 0};
}

void check_slots(const int64_t* p, const int64_t* o, int64_t M, int64_t pages, int64_t bs, const char* what) {
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < pages && o[i] >= 0 && o[i] < bs, what, " token ", i, " (page ", p[i],
                ", offset ", o[i], ") is outside the cache (", pages, " head-pages x ", bs, ")");
}

// ------------------------------------------------------------------------------------------------- ops
void compact(Tensor kc, Tensor vc, Tensor src_page, Tensor src_off, Tensor dst_page, Tensor dst_off) {
  check_cache_pair(kc, vc);
  const int64_t M = src_page.numel();
  TORCH_CHECK(src_off.numel() == M && dst_page.numel() == M && dst_off.numel() == M, "index lengths differ");
  if (M == 0) return;
  Tensor sp = as_long(src_page), so = as_long(src_off), dp = as_long(dst_page), dof = as_long(dst_off);
  base_kernels(level()).compact(cache_view(kc), cache_view(vc), kc.element_size(), sp.data_ptr<int64_t>(),
                                so.data_ptr<int64_t>(), dp.data_ptr<int64_t>(), dof.data_ptr<int64_t>(), M);
}

// every page id of one layer's list inside that layer's cache (of ``pages`` head-pages)
static void check_page_ids(const char* op, const int64_t* ids, int64_t M, int64_t pages, int64_t layer) {
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(ids[m] >= 0 && ids[m] < pages, op, ": page id ", ids[m], " (layer ", layer, ", index ", m,
                ") is outside the cache (", pages, " head-pages)");
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
  const Kernels& k = base_kernels(level());
  for (int64_t l = 0; l < L; ++l) {
    const Tensor& c = caches[l];
    TORCH_CHECK(c.element_size() == es && cache_bs(c) == bs && cache_d(c) == D, "gather_pages: layer ", l,
                "'s cache differs from layer 0's");
    const int64_t pages = c.size(0) * c.size(1);
    const int64_t* li = ip + (idx.dim() == 2 ? l * M : 0);
    check_page_ids("gather_pages", li, M, pages, l);
    k.gather(cache_view(c), es, li, M, static_cast<char*>(out.data_ptr()) + l * M * bs * D * es);
  }
}

// fp8 caches (uint8), one per layer; ids [M] or [L, M]; luts [L, 256] fp32 (layer l's table, its scale
// included); out [L, M, bs, D] fp32
void gather_pages_lut(at::TensorList caches, Tensor ids, Tensor luts, Tensor out) {
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(L > 0, "gather_pages_lut: no caches");
  const Tensor idx = as_long(ids);
  const int64_t M = idx.size(-1);
  TORCH_CHECK(idx.dim() == 1 || (idx.dim() == 2 && idx.size(0) == L), "gather_pages_lut: ids must be [M] or [L, M]");
  const int64_t bs = cache_bs(caches[0]), D = cache_d(caches[0]);
  TORCH_CHECK(luts.scalar_type() == at::kFloat && luts.is_contiguous() && luts.dim() == 2 && luts.size(0) == L &&
                  luts.size(1) == 256,
              "gather_pages_lut: luts must be a contiguous [L, 256] fp32 tensor");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 4 && out.size(0) == L && out.size(1) == M && out.size(2) == bs &&
                  out.size(3) == D && out.scalar_type() == at::kFloat,
              "gather_pages_lut: out must be a contiguous [L, M, bs, D] fp32 tensor");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const Kernels& k = base_kernels(level());
  for (int64_t l = 0; l < L; ++l) {
    const Tensor& c = caches[l];
    TORCH_CHECK(c.scalar_type() == at::kByte && cache_bs(c) == bs && cache_d(c) == D, "gather_pages_lut: layer ", l,
                "'s cache is not an fp8 (uint8) cache like layer 0's");
    const int64_t pages = c.size(0) * c.size(1);
    const int64_t* li = ip + (idx.dim() == 2 ? l * M : 0);
    check_page_ids("gather_pages_lut", li, M, pages, l);
    RawCache x = cache_view(c);
    x.lut = luts.data_ptr<float>() + l * 256;
    k.gather_lut(x, li, M, out.data_ptr<float>() + l * M * bs * D);
  }
}

Tensor as_f32_contig(const Tensor& t, bool& copied) {
  TORCH_CHECK(t.device().is_cpu(), "moments must be CPU tensors");
  copied = !(t.scalar_type() == at::kFloat && t.is_contiguous());
  return copied ? t.to(at::kFloat).contiguous() : t;
}

void accumulate_moments(Tensor kc, Tensor vc, Tensor page_ids, Tensor offsets, Tensor head_of_token, Tensor n,
                        Tensor sum_k, Tensor sum_v, Tensor sum_vk, const std::optional<Tensor>& k_lut,
                        const std::optional<Tensor>& v_lut) {
  check_cache_pair(kc, vc);
  RawCache K = cache_view(kc), V = cache_view(vc);
  K.lut = lut_of(kc, k_lut, "accumulate_moments", "k_lut");
  V.lut = lut_of(vc, v_lut, "accumulate_moments", "v_lut");
  const int64_t M = page_ids.numel(), D = cache_d(kc), Hm = n.numel();
  TORCH_CHECK(offsets.numel() == M && head_of_token.numel() == M, "index lengths differ");
  TORCH_CHECK(sum_k.numel() == Hm * D && sum_v.numel() == Hm * D && sum_vk.numel() == Hm * D * D,
              "moments must be n [H], sum_k [H, D], sum_v [H, D], sum_vk [H, D, D]");
  if (M == 0) return;
  const Dtype dt = dtype_of(kc.scalar_type(), "accumulate_moments");
  Tensor p = as_long(page_ids), o = as_long(offsets), h = as_long(head_of_token);
  check_slots(p.data_ptr<int64_t>(), o.data_ptr<int64_t>(), M, kc.size(0) * kc.size(1), cache_bs(kc), "token");
  const int64_t* hp = h.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(hp[i] >= 0 && hp[i] < Hm, "head_of_token ", hp[i], " outside [0, ", Hm, ")");
  bool cn, ck, cv, cvk;
  Tensor n2 = as_f32_contig(n, cn), k2 = as_f32_contig(sum_k, ck), v2 = as_f32_contig(sum_v, cv),
         vk2 = as_f32_contig(sum_vk, cvk);
  base_kernels(level()).accumulate(dt, K, V, p.data_ptr<int64_t>(), o.data_ptr<int64_t>(),
                                   hp, M, Hm, n2.data_ptr<float>(), k2.data_ptr<float>(), v2.data_ptr<float>(),
                                   vk2.data_ptr<float>());
  if (cn) n.copy_(n2.view(n.sizes()));
  if (ck) sum_k.copy_(k2.view(sum_k.sizes()));
  if (cv) sum_v.copy_(v2.view(sum_v.sizes()));
  if (cvk) sum_vk.copy_(vk2.view(sum_vk.sizes()));
}

std::tuple<Tensor, Tensor> ragged_decode_attention(Tensor query, Tensor kc, Tensor vc, Tensor page_table,
                                                   Tensor seq_lens, double scale, const std::optional<Tensor>& n,
                                                   const std::optional<Tensor>& sum_k,
                                                   const std::optional<Tensor>& sum_v,
                                                   const std::optional<Tensor>& sum_vk,
                                                   const std::optional<Tensor>& k_lut,
                                                   const std::optional<Tensor>& v_lut) {
  check_cache_pair(kc, vc);
  RawCache K = cache_view(kc), V = cache_view(vc);
  K.lut = lut_of(kc, k_lut, "ragged_decode_attention", "k_lut");
  V.lut = lut_of(vc, v_lut, "ragged_decode_attention", "v_lut");
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
  const Idx pt = index_of(page_table), sl = index_of(sl2);
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
  const Dtype dt = dtype_of(kc.scalar_type(), "ragged_decode_attention");
  // the query is read in its own dtype when it matches the cache (else as fp32); the output has its dtype.
  // An fp8 cache's query is read in its own dtype (fp32, bf16 or fp16; others as fp32)
  const bool fp8 = dt == Dtype::fp8;
  const at::ScalarType qt = query.scalar_type();
  const bool q_own = fp8 && (qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf);
  const bool same = qt == kc.scalar_type() || q_own;
  const Tensor q = same ? query : query.to(at::kFloat);
  const Dtype q_type = q_own ? dtype_of(qt, "ragged_decode_attention") : Dtype::f32;
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
  const int l = level();
  DecodeArgs a{dt, same, q_type, q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), K, V, D,
               pt, P, sl, T_, H, Hq / H, static_cast<float>(scale),
               has_m ? mn.data_ptr<float>() : nullptr, has_m ? msk.data_ptr<float>() : nullptr,
               has_m ? msv.data_ptr<float>() : nullptr, has_m ? msvk.data_ptr<float>() : nullptr,
               out.data_ptr(), lse.data_ptr<float>(), l == kAmx};
  // above avx512 only a bf16 query on a bf16 cache has kernels of its own
  if (!(l >= kAvx512Bf16 && kernels_avx512_bf16().decode(a))) base_kernels(l).decode(a);
  return {same || query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type()), lse};
}

}  // namespace
}  // namespace contour

TORCH_LIBRARY(vllm_contour, m) {
  m.def("compact(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor src_page, Tensor src_off, "
        "Tensor dst_page, Tensor dst_off) -> ()");
  m.def("accumulate_moments(Tensor key_cache, Tensor value_cache, Tensor page_ids, Tensor offsets, "
        "Tensor head_of_token, Tensor(a!) n, Tensor(b!) sum_k, Tensor(c!) sum_v, Tensor(d!) sum_vk, "
        "Tensor? k_lut=None, Tensor? v_lut=None) -> ()");
  m.def("ragged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor page_table, "
        "Tensor seq_lens, float scale, Tensor? n=None, Tensor? sum_k=None, Tensor? sum_v=None, "
        "Tensor? sum_vk=None, Tensor? k_lut=None, Tensor? v_lut=None) -> (Tensor, Tensor)");
  m.def("gather_pages(Tensor[] caches, Tensor ids, Tensor(a!) out) -> ()");
  m.def("gather_pages_lut(Tensor[] caches, Tensor ids, Tensor luts, Tensor(a!) out) -> ()");
  m.def("decode_path(str layout=\"amx\") -> str", &contour::decode_path);
  m.def("cpu_isa() -> str", &contour::cpu_isa);
  m.def("set_cpu_isa(str isa) -> str", &contour::set_cpu_isa);
  m.def("cpu_isas() -> str[]", &contour::cpu_isas);
  m.def("cpu_isa_missing(str isa) -> str", &contour::cpu_isa_missing);
  m.def("cpu_baseline() -> str", &contour::cpu_baseline);
}

TORCH_LIBRARY_IMPL(vllm_contour, CPU, m) {
  m.impl("compact", &contour::compact);
  m.impl("accumulate_moments", &contour::accumulate_moments);
  m.impl("ragged_decode_attention", &contour::ragged_decode_attention);
  m.impl("gather_pages", &contour::gather_pages);
  m.impl("gather_pages_lut", &contour::gather_pages_lut);
}

// An (empty) Python module, so that `import vllm_contour._C` loads the library and runs the registrations.
#define CONTOUR_CAT_(a, b) a##b
#define CONTOUR_CAT(a, b) CONTOUR_CAT_(a, b)
extern "C" PyMODINIT_FUNC CONTOUR_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "vllm-contour CPU kernels: torch.ops.vllm_contour.*",
                                   -1, nullptr};
  return PyModule_Create(&def);
}
