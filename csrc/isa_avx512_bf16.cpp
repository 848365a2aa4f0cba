// vllm-contour's kernels at the avx512_bf16 level: the avx512 level's + AVX512_BF16, decode of a bf16
// query on a bf16 cache only; with the amx level's helpers (AMX-TILE, AMX-BF16: functions of their own,
// kernels.inc).
// contour_ops.cpp runs them where the CPU has these instructions (contour.h). Only this file's functions
// use them: the pragma comes after every header, and the table below is baseline code.
#include "contour.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16")
#define CONTOUR_ISA_AVX2 1
#define CONTOUR_ISA_AVX512 1
#define CONTOUR_ISA_AVX512_BF16 1
#define CONTOUR_DECODE_BF16_ONLY 1
#define CONTOUR_KERNELS_INCLUDER 1

namespace contour::isa_avx512_bf16 {
namespace {
#include "kernels.inc"
}  // namespace
}  // namespace contour::isa_avx512_bf16

#pragma GCC pop_options

namespace contour {

constexpr const char* kTarget =
    "avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16";

const Kernels& kernels_avx512_bf16() {
  static const Kernels k{"avx512_bf16", kTarget, nullptr, nullptr, nullptr, nullptr, &isa_avx512_bf16::decode};
  return k;
}

}  // namespace contour
