// Software prefetches as inline assembly. GCC 12.2 drops `_mm_prefetch`
// (`__builtin_prefetch`) from some of our kernels' loops: building every prefetch as
// assembly (2026-12-05, avx512_bf16 objects compared function by function) put prefetch
// instructions where the intrinsic's build had none: INT8 / INT4 decode tiles but the 1 x 4
// one (quant_gemm.h prefetch_ahead), the k-blocked INT8 GEMM, FP8's scale prefetch
// (Fp8Format::prefetch_scales: no instruction at all), and some of those in
// BF16's and FP8's tiles. An `asm volatile` instruction is never removed. Used where a
// paired A/B measured the prefetches the source asks for (quant_gemm.h). Not elsewhere:
// BF16's and FP8's tiles keep the intrinsic (docs/formats.md, "Software prefetches": with
// them as assembly 512-token S1 BF16 took 0.975 of the time, FP8 1.06x).
//
// The address is an address operand ("p"), not a memory operand ("m"(*p)): a memory
// operand tells GCC the asm reads *p, and the kernels prefetch past their buffers' ends on
// purpose (a prefetch never faults). Paired against "m" (2-core Zen 4, avx512_bf16, one
// thread, scripts/ab_pair.py, 2 rounds of 12 calls, 2026-12-05), 1 / 8 tokens: S1 AMXINT8
// 1.02 / 0.94 (0.87-1.01) of the time, AMXINT4 1.00 / 0.99, S2 GPTQ_INT4 0.99 / 0.99.
#pragma once

namespace kt::cpu {

// The 64-byte line holding p to L1 (and L2): prefetcht0.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %a0" : : "p"(p)); }

// The 64-byte line holding p to L2 (not L1): prefetcht1.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %a0" : : "p"(p)); }

}  // namespace kt::cpu
