// [NOTE] e4m3 decoding for the AVX-512 variants (fp8_format.h): 32 codes (one k-pair of a
// block, in the BF16 line's order, fp8_layout.h) -> the BF16 line of w / 256, exactly, in
// six integer operations. Sign-extended to 16 bits, a code shifted left by 4 holds its sign
// at bit 15 and its magnitude (4-bit exponent, 3-bit mantissa) at bits 4-10, where bf16
// keeps them; OR-ing 112 into the exponent rebiases it (e4m3's 7 -> bf16's 127, less 8:
// w / 256, so the largest code, 448, stays a finite bf16 after any mxfp8 scale). Exponent 0
// (zero and the subnormals m 2^-9) takes its bf16 from an 8-entry vpermw table.
// NaN codes decode as 480 / 256: the packer makes their scales NaN (mxfp8: the row's NaN
// addend), fp8_layout.h. mxfp8 adds its scale's exponent to the bf16 exponent of nonzero
// codes (exact: the packer keeps exponent codes in [10, 246], so results stay normal).
// The weight sources plug these lines into the BF16 micro-kernels (bf16_gemm_*.h), so the
// FP8 formats multiply exactly what a BF16 line of the same values would.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../isa/vec_avx512.h"
#include "../bf16/bf16_gemm.h"
#include "fp8_kblock.h"
#include "../bf16/bf16_gemm_avx512.h"
#include "../bf16/bf16_gemm_avx512_bf16.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// bf16 bits of m 2^-17 (e4m3 exponent 0, mantissa m, divided by 256) at index m.
inline __m512i fp8_subnormal_table() {
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x3860, 0x3840,
                          0x3820, 0x3800, 0x37c0, 0x3780, 0x3700, 0);
}

// mxfp8: the 32-word exponent addend of one group of a block (kMxGroupBytesAvx512 bytes).
constexpr int64_t kMxGroupBytesAvx512 = 64;

// The 32 codes at `codes`, sign-extended to 16 bits.
KT_FP8_INLINE __m512i fp8_code_words(const uint8_t* codes) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
}

// Sign and rebiased magnitude of code words x: the BF16 line where no code has exponent 0.
KT_FP8_INLINE __m512i fp8_rebias(__m512i x) {
  return _mm512_ternarylogic_epi32(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(static_cast<int16_t>(0x87f0)),
                                   _mm512_set1_epi16(0x3800), 0xea);  // (a & b) | c
}

// The BF16 line of k-pair p of an FP8 block at `codes` (32 bytes); Mx: plus the exponent
// addend at `addend` on nonzero codes.
template <bool Mx>
KT_FP8_INLINE __m512i fp8_bf16_line(const uint8_t* codes, const uint8_t* addend) {
  const __m512i x = fp8_code_words(codes);
  __m512i r = fp8_rebias(x);
  const __mmask32 exponent_zero = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));
  // A line without exponent-zero codes (zeros, subnormals; most lines of a checkpoint)
  // is done here: r already holds every code's sign, and mxfp8 adds its addend (every
  // code nonzero); the table, the sign and the nonzero mask only where needed.
  // Bit-identical. mxfp8, both ways interleaved call by call in one process (Zen 5,
  // avx512_bf16, 2026-11-27, 30-40 calls): 8 tokens S1 0.96 and S2 0.94 of the time,
  // 1 token 0.98-0.99, 512 tokens 0.98. fp8 (two operations fewer, not four): Zen 5
  // 0.94-1.03; Intel Xeon AMX VM (amx, 2026-12-02, scripts/ab_pair.py, 24 calls x 2
  // rounds): S1/S2 FP8 and S1 FP8_PERCHANNEL at 1 and 8 tokens 0.87-0.91, 512 tokens 0.93.
  if (__builtin_expect(exponent_zero == 0, 1)) return Mx ? _mm512_add_epi16(r, _mm512_loadu_si512(addend)) : r;
  r = _mm512_mask_permutexvar_epi16(r, exponent_zero, x, fp8_subnormal_table());
  r = _mm512_ternarylogic_epi32(r, x, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xf8);  // r | (x & sign)
  if constexpr (Mx) {
    const __mmask32 nonzero = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x7f));
    r = _mm512_mask_add_epi16(r, nonzero, r, _mm512_loadu_si512(addend));
  }
  return r;
}

// Weight sources over FP8 blocks: `block` is a block's first code byte (as uint16_t*),
// pair p at byte 32 p. Mx: pair p of block b adds the exponents at
// mx + b * kMxBlockBytes + (p / 16) * kMxGroupBytes (the pairs of a call start on a 32-k
// group). Store: the decoded BF16 line of block b, pair p also goes to
// out[b * out_stride + 32 p] (prefill: the first row tile decodes for the others).
template <bool Mx, bool Store>
struct Fp8LinesAvx512Bf16 {
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx512;
  static constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * kMxGroupBytes;
  const uint8_t* mx = nullptr;
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  NextTile next;
  KT_FP8_INLINE __m512i line(const uint16_t* block, int b, int64_t p) const {
    const __m512i bf16 = fp8_bf16_line<Mx>(reinterpret_cast<const uint8_t*>(block) + p * 32, addend(b, p));
    if constexpr (Store) _mm512_storeu_si512(out + b * out_stride + p * 32, bf16);
    return bf16;
  }
  // Pairs p and p + 1 (p even: one 64-byte line of codes per block, one mxfp8 group) of NB
  // blocks for the micro-kernel (kHasTwoPairs, bf16_gemm_avx512_bf16.h): one exponent-zero
  // test per 64 bytes and one branch for all 2 NB lines; without such codes every line
  // is fp8_bf16_line's short way, else each takes `line`. One code prefetch per 64 bytes.
  // Bit-identical to `line`. Intel Xeon AMX VM (amx, 2026-12-03, scripts/ab_pair.py, both
  // ways from one build, 12 calls x 2 rounds): S1/S2 MXFP8 at 1 and 8 tokens 0.90-0.92 of
  // the time, S1 FP8_PERCHANNEL 0.96-0.97, FP8 0.95-1.01. A GFNI + VBMI decode of the
  // two lines (4 operations instead of 6) showed no gain over this in noisy runs: not kept.
  static constexpr bool kTwoPairs = true;
  template <int NB, class Step>
  KT_FP8_INLINE void two_pairs(const uint16_t* w, int64_t block_stride, int64_t p, int64_t ahead, Step&& step) const {
    __mmask64 exponent_zero = 0;
    for (int b = 0; b < NB; ++b) {
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(w + b * block_stride) + p * 32;
      exponent_zero |= _mm512_testn_epi8_mask(_mm512_loadu_si512(codes), _mm512_set1_epi8(0x78));
      fp8_prefetch(w + b * block_stride, p, ahead, next);
    }
    if (__builtin_expect(exponent_zero == 0, 1)) {
      for (int64_t q = p; q < p + 2; ++q) {
        __m512i lines[NB];
        for (int b = 0; b < NB; ++b) {
          lines[b] = fp8_rebias(fp8_code_words(reinterpret_cast<const uint8_t*>(w + b * block_stride) + q * 32));
          if constexpr (Mx) lines[b] = _mm512_add_epi16(lines[b], _mm512_loadu_si512(addend(b, q)));
          if constexpr (Store) _mm512_storeu_si512(out + b * out_stride + q * 32, lines[b]);
        }
        step(q, lines);
      }
    } else {
      each_line<NB>(w, block_stride, p, step);
    }
  }
  // two_pairs where some code has exponent 0: every line through `line`.
  template <int NB, class Step>
  KT_FP8_INLINE void each_line(const uint16_t* w, int64_t block_stride, int64_t p, Step&& step) const {
    for (int64_t q = p; q < p + 2; ++q) {
      __m512i lines[NB];
      for (int b = 0; b < NB; ++b) lines[b] = line(w + b * block_stride, b, q);
      step(q, lines);
    }
  }
  KT_FP8_INLINE void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const {
    fp8_prefetch(block, p, ahead, next);
  }
  // mxfp8: pair p of block b's exponent addend.
  KT_FP8_INLINE const uint8_t* addend(int b, int64_t p) const { return mx + b * kMxBlockBytes + (p >> 4) * kMxGroupBytes; }
};

// The same lines widened to fp32 for the AVX-512F micro-kernel (as Bf16LinesAvx512 does).
template <bool Mx, bool Store>
struct Fp8LinesAvx512 : Fp8LinesAvx512Bf16<Mx, Store> {
  KT_FP8_INLINE void widen(const uint16_t* block, int b, int64_t p, __m512& even, __m512& odd) const {
    widen_bf16_line(this->line(block, b, p), even, odd);
  }
};

// What fp8_format.h needs of an ISA: the BF16 micro-kernel, its FP8 weight sources, and
// the mxfp8 scale preparation.
template <class MicroT, template <bool, bool> class LinesT>
struct Fp8OpsAvx512 {
  using Micro = MicroT;
  template <bool Mx, bool Store = false>
  using Lines = LinesT<Mx, Store>;
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx512;

  // 16 exponent codes e (one group of a block's rows, in [10, 246] or 255) -> the words
  // (e - 119) << 7 for both k of each row (line order): bf16 exponent + (e - 127) + 8.
  static void mx_prepare(const uint8_t* codes, uint8_t* out) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i word = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(119)), 7);
    _mm512_storeu_si512(out, _mm512_or_si512(_mm512_and_si512(word, _mm512_set1_epi32(0xffff)),
                                             _mm512_slli_epi32(word, 16)));
  }
};

using Fp8OpsAvx512Bf16 = Fp8OpsAvx512<Bf16GemmAvx512Bf16, Fp8LinesAvx512Bf16>;
using Fp8OpsAvx512F = Fp8OpsAvx512<Bf16GemmAvx512, Fp8LinesAvx512>;

}  // namespace
}  // namespace kt::cpu
