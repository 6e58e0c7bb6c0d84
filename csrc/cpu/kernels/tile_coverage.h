// What a whole-GEMM tile path (AMX) computed, so the driver runs the rest with vector
// micro-kernels: k steps [0, pairs) of output blocks [0, blocks). BF16 counts k in pairs,
// the INT8/INT4 drivers in single k.
#pragma once

#include <cstdint>

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct TileCoverage {
  int64_t pairs;
  int blocks;
};

}  // namespace
}  // namespace kt::cpu
