// vllm-contour's kernels at the avx512 level: x86-64-v4 (the avx2 level's + AVX-512 F/BW/VL/DQ/CD).
// contour_ops.cpp runs them where the CPU has these instructions (contour.h). Only this file's functions
// use them: the pragma comes after every header, and the table below is baseline code.
#include "contour.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
#define CONTOUR_ISA_AVX2 1
#define CONTOUR_ISA_AVX512 1
#define CONTOUR_KERNELS_INCLUDER 1

namespace contour::isa_avx512 {
namespace {
#include "kernels.inc"
}  // namespace
}  // namespace contour::isa_avx512

#pragma GCC pop_options

namespace contour {

constexpr const char* kTarget = "avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd";

const Kernels& kernels_avx512() {
  static const Kernels k{"avx512", kTarget, &isa_avx512::compact, &isa_avx512::gather, &isa_avx512::gather_lut,
                         &isa_avx512::accumulate,
                         &isa_avx512::decode};
  return k;
}

}  // namespace contour
