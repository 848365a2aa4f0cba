// vllm-contour's kernels at the generic level: the kernels' plain loops, vectorised for the compile flags only
// (setup.py's baseline, x86-64-v2 by default: SSE4.2). contour_ops.cpp runs them where the CPU has nothing
// better, or where a lower level is forced (contour.h).
#include "contour.h"

#define CONTOUR_KERNELS_INCLUDER 1

namespace contour::isa_generic {
namespace {
#include "kernels.inc"
}  // namespace
}  // namespace contour::isa_generic

namespace contour {

constexpr const char* kTarget = "";

const Kernels& kernels_generic() {
  static const Kernels k{"generic", kTarget, &isa_generic::compact, &isa_generic::gather, &isa_generic::gather_lut,
                         &isa_generic::accumulate,
                         &isa_generic::decode};
  return k;
}

}  // namespace contour
