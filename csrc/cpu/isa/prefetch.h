// Software prefetches as inline assembly. GCC 12.2 drops `_mm_prefetch`
// (`__builtin_prefetch`) from some of our kernels' loops: building every prefetch as
// assembly (2026-12-05, avx512_bf16 objects compared function by function) put prefetch
// instructions where the intrinsic's build had none: INT8 / INT4 decode tiles but the 1 x 4
// one (quant_gemm.h prefetch_ahead), the k-blocked INT8 GEMM, FP8's scale prefetch
// (Fp8Format::prefetch_scales: no instruction at all), and some of those in
// BF16's and FP8's tiles. An `asm volatile` instruction is never removed. Used where a
// paired A/B measured the prefetches the source asks for (quant_gemm.h). Not yet elsewhere:
// bf16_gemm.h's prefetches as assembly took S1 BF16 512-token prefill to 0.92 of the time
// but S1 FP8's (the same tiles over FP8 lines) to 2.28x, so the FP8 tiles' prefetch
// distances must be fixed first (2-core Zen 4, avx512_bf16, scripts/ab_pair.py --a
// <previous build>, 2 rounds of 8 calls, 2026-12-05; all kernels' prefetches as assembly:
// also FP8 2.27x, Q8_0 8 tokens 1.08x, 1 token 0.93x).
#pragma once

namespace kt::cpu {

// The 64-byte line holding p to L1 (and L2): prefetcht0.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

// The 64-byte line holding p to L2 (not L1): prefetcht1.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

}  // namespace kt::cpu
