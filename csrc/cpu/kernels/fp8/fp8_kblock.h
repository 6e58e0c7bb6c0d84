// What the FP8 kernels share across ISAs: the k block (fp8_format.h), the mxfp8 group
// geometry the weight sources (fp8_decode_*.h) rely on, and the sources' code prefetch.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../formats/fp8_layout.h"
#include "../bf16/bf16_gemm.h"

namespace kt::cpu {

constexpr int64_t kFp8KBlockPairs = 128;  // 256 k: whole fp8 (128) and mxfp8 (32) groups
constexpr int64_t kMxGroupPairs = fp8_layout::kMxGroup / 2;
constexpr int64_t kMxGroupsPerKBlock = kFp8KBlockPairs / kMxGroupPairs;
static_assert(kFp8KBlockPairs * 2 % fp8_layout::kBlockGroup == 0, "k blocks must hold whole fp8 groups");
static_assert(kMxGroupPairs == 16, "the weight sources find a pair's mxfp8 group as p >> 4");

// The weight sources run once per k-pair and block inside the micro-kernels' loops: GCC
// did not inline them there on its own (a call per pair, the accumulators spilled around
// it: 512-token mxfp8 2.2x the BF16 layer's time).
#define KT_FP8_INLINE inline __attribute__((always_inline))

// Prefetches the codes 2 * `ahead` pairs after pair p of a block (the byte distance of
// the BF16 lines at `ahead`; past next.end, in the next group's block); a 64-byte line
// holds two pairs, so every line is asked for twice (cheaper here than a test of p's
// parity).
KT_FP8_INLINE void fp8_prefetch(const uint16_t* block, int64_t p, int64_t ahead, const NextTile& next) {
  if (ahead <= 0) return;
  const int64_t q = p + 2 * ahead;
  _mm_prefetch(reinterpret_cast<const char*>(block) + q * 32 + (q >= next.end ? next.wrap : 0), _MM_HINT_T0);
}

}  // namespace kt::cpu
