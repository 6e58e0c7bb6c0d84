// What the FP8 kernels share across ISAs: the k block (fp8_format.h), the mxfp8 group
// geometry the weight sources (fp8_decode_*.h) rely on, and the sources' code prefetch.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../formats/fp8_layout.h"
#include "../bf16/bf16_gemm.h"

namespace kt::cpu {

constexpr int64_t kFp8KBlockPairs = 128;  // fp8 decode: 256 k, whole fp8 (128) and mxfp8 (32) groups
// Prefill: k blocks of 2048 k (all of a 2048-wide layer's), whose BF16 lines the decoding
// row tile stores for the later ones (4 blocks: 256 KiB, in L2). Bit-identical to 256-k
// blocks; in one process, both interleaved call by call (Zen 5, avx512_bf16, 2026-11-27,
// 11-15 calls), 512 tokens: S1 MXFP8 0.90, FP8_PERCHANNEL 0.94 (k blocks of 1024 k), FP8
// 0.97 of the time; S2 0.90 / 0.92 / 0.97; S1 on avx512 0.93 / 0.96 / 0.98, on avx2 0.96 /
// 0.98 / 0.98 (Zen 5's 1 MiB L2; Zen 3's 512 KiB not measured).
// Decode: mxfp8 and fp8_perchannel in these 2048-k blocks too, fp8 (a flush per 128 k
// whatever the block) in 256-k ones (Fp8Format::kDecodeKBlock). Bit-identical; paired A/B
// against 256 k (2-core Zen 4, 2026-12-07, scripts/ab_pair.py with a run-time switch in
// one build, 2 rounds of 10-12 calls), 1 / 8 tokens, avx512_bf16: S1 MXFP8 0.96-0.97 / 1.005,
// S2 MXFP8 0.92-0.95 / 0.99, S1 FP8_PERCHANNEL 0.93 / 0.99, S2 FP8_PERCHANNEL 0.99 / 0.98,
// fp8 1.01-1.04 / 0.98-1.01 (so left at 256); forced to avx512 / avx2, S1 MXFP8 0.95 / 0.94
// at 1 token, 0.99 / 0.97 at 8, FP8_PERCHANNEL 1.00-1.02. (Zen 5 in 2026-11 read 1.02-1.03
// for 2048-k MXFP8 decode blocks, before the exponents' prefetch per block group.)
constexpr int64_t kFp8PrefillKBlockPairs = 1024;
constexpr int64_t kMxGroupPairs = fp8_layout::kMxGroup / 2;
constexpr int64_t kMxGroupsPerKBlock = kFp8PrefillKBlockPairs / kMxGroupPairs;  // the larger k block's
static_assert(kFp8KBlockPairs * 2 % fp8_layout::kBlockGroup == 0, "k blocks must hold whole fp8 groups");
static_assert(kFp8PrefillKBlockPairs * 2 % fp8_layout::kBlockGroup == 0, "k blocks must hold whole fp8 groups");
static_assert(kFp8PrefillKBlockPairs >= kFp8KBlockPairs, "the mxfp8 exponent buffer holds either k block");
static_assert(kMxGroupPairs == 16, "the weight sources find a pair's mxfp8 group as p >> 4");

// The weight sources run once per k-pair and block inside the micro-kernels' loops: GCC
// did not inline them there on its own (a call per pair, the accumulators spilled around
// it: 512-token mxfp8 2.2x the BF16 layer's time).
#define KT_FP8_INLINE inline __attribute__((always_inline))

// Prefetches the codes 2 * `ahead` pairs after pair p of a block (the byte distance of
// the BF16 lines at `ahead`; past next.end, in the next group's block); a 64-byte line
// holds two pairs, so every line is asked for twice (cheaper here than a test of p's
// parity). To L2: on a 2-core Zen 4 (scripts/ab_pair.py, a run-time switch in one build,
// 2 rounds of 12 calls, 2026-12-04) L2 instead of L1 took 1 / 8 / 64 tokens S1 FP8 to
// 0.90-0.92 / 0.90 / 0.99 of the time and S2 FP8 1 / 64 to 0.93 / 0.98 on avx512_bf16,
// S1 FP8 1 / 8 to 0.92 / 0.95 forced to avx2.
KT_FP8_INLINE void fp8_prefetch(const uint16_t* block, int64_t p, int64_t ahead, const NextTile& next) {
  if (ahead <= 0) return;
  const int64_t q = p + 2 * ahead;
  _mm_prefetch(reinterpret_cast<const char*>(block) + q * 32 + (q >= next.end ? next.wrap : 0), _MM_HINT_T1);
}

}  // namespace kt::cpu
