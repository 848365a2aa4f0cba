// vllm-contour's kernels at the avx2 level: x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE).
// contour_ops.cpp runs them where the CPU has these instructions (contour.h). Only this file's functions
// use them: the pragma comes after every header, and the table below is baseline code.
#include "contour.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe")
#define CONTOUR_ISA_AVX2 1
#define CONTOUR_KERNELS_INCLUDER 1

namespace contour::isa_avx2 {
namespace {
#include "kernels.inc"
}  // namespace
}  // namespace contour::isa_avx2

#pragma GCC pop_options

namespace contour {

constexpr const char* kTarget = "avx2,fma,f16c,bmi,bmi2,lzcnt,movbe";

const Kernels& kernels_avx2() {
  static const Kernels k{"avx2", kTarget, &isa_avx2::compact, &isa_avx2::gather, &isa_avx2::gather_lut,
                         &isa_avx2::accumulate,
                         &isa_avx2::decode};
  return k;
}

}  // namespace contour
