// [NOTE] e4m3 decoding for the AVX2 variants (fp8_format.h), two ways.
// fp8 and fp8_perchannel (Fp8SplitLinesAvx2, below): integer operations only, to the fp32
// value of w * 2^-120 (e4m3 subnormals are fp32 subnormals), in 9 vector instructions per
// 32 codes and in a split row order (even rows | odd rows) the micro-kernel undoes at its stores; the activation
// rows are normalized by a power of two to keep the products normal. An earlier integer
// path multiplied by 2^120 to get w back (or checked for subnormal codes) and measured no
// faster than fp16: the multiply was what cost.
// mxfp8 decode (Fp8MxSplitLinesAvx2) multiplies that by 2^(e - 7), where every exponent
// code of the k block is at most 134 (real checkpoints' are far below); mxfp8 prefill and
// the other k blocks go through fp16 (Fp8LinesAvx2), since the power-of-two scales
// (2^-117 ... 2^119) times w * 2^-120 would leave fp32's range: AVX2 has no 16-bit permute for
// fp8_decode_avx512.h's subnormal table, so one vpshufb per k puts the k (or k + 1) code of
// each of a line's 16 rows into the top byte of a 16-bit lane (rows in order, 0-7 | 8-15),
// an arithmetic shift by one and a mask make it an fp16 of w / 256 (s, 0eeee, mmm0000000:
// e4m3's exponent bias 7 read with fp16's 15; e4m3 subnormals are fp16 subnormals), and
// vcvtph2ps widens it exactly: 32 codes in 12 vector instructions after the load, 4 of
// them two-uop vcvtph2ps on Zen 3 (the first version decoded in line order and reordered
// the lanes, 22; paired A/B on Zen 3, 2026-11-26: 1-token S1/S2 decode 0.60x its time);
// ~12 GB/s of codes per core in a loop from L1 with the fmas. mxfp8 then multiplies by
// 2^(e - 127) * 256 in fp32 (exact). Prefill stores the BF16 lines (exact: every decoded
// value is a bf16, subnormals included).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../isa/vec_avx2.h"
#include "../bf16/bf16_gemm.h"
#include "../bf16/bf16_gemm_avx2.h"
#include "fp8_kblock.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// mxfp8: one group of a block as 16 floats, the rows' scales in row order.
constexpr int64_t kMxGroupBytesAvx2 = 64;

// vpshufb indexes: per 128-bit lane (8 rows of a line, bytes 2n + i), code i of row n to the
// top byte of 16-bit lane n, zero below it.
KT_FP8_INLINE __m256i fp8_pick_avx2(int i) {
  return i == 0 ? _mm256_setr_epi8(-1, 0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1, 12, -1, 14,  //
                                   -1, 0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1, 12, -1, 14)
                : _mm256_setr_epi8(-1, 1, -1, 3, -1, 5, -1, 7, -1, 9, -1, 11, -1, 13, -1, 15,  //
                                   -1, 1, -1, 3, -1, 5, -1, 7, -1, 9, -1, 11, -1, 13, -1, 15);
}

// Codes of k-pair p of a block (32 bytes, line order) -> fp32 w / 256 of rows 0-7 (v[0])
// and 8-15 (v[1]) at k + i (i = 0: k, 1: k + 1), times the rows' scales mx[0, 16).
KT_FP8_INLINE void fp8_decode_k_avx2(__m256i line, int i, const float* mx, __m256 (&v)[2]) {
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_shuffle_epi8(line, fp8_pick_avx2(i)), 1),
                                        _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  v[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), _mm256_loadu_ps(mx));
  v[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), _mm256_loadu_ps(mx + 8));
}

// The mxfp8 weight source of the AVX2 micro-kernel through fp16 (as fp8_decode_avx512.h's
// Lines): the scales of pair p of block b at mx + b * kMxBlockBytes + (p / 16) * kMxGroupBytes.
// fp8 and fp8_perchannel decode through Fp8SplitLinesAvx2 on AVX2 (fp8_format.h's kSplit),
// so only Mx = true exists here.
template <bool Mx, bool Store>
struct Fp8LinesAvx2 {
  static_assert(Mx, "AVX2 decodes fp8 and fp8_perchannel through Fp8SplitLinesAvx2");
  // Decoded in turn: 4 decoded blocks next to 8 accumulators spilled to the stack
  // (1-token S1: 1958 -> 1903 us; 512 tokens, widened blocks first: 1.23x slower).
  static constexpr bool kWidenInTurn = true;
  static constexpr bool kSplitLanes = false;
  static constexpr bool kOutlined = false;
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx2;
  static constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * kMxGroupBytes;
  const uint8_t* mx = nullptr;
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  NextTile next;
  KT_FP8_INLINE void widen(const uint16_t* block, int b, int64_t p, __m256 (&even)[2], __m256 (&odd)[2]) const {
    const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint8_t*>(block) + p * 32));
    const float* scale = reinterpret_cast<const float*>(mx + b * kMxBlockBytes + (p >> 4) * kMxGroupBytes);
    fp8_decode_k_avx2(line, 0, scale, even);
    fp8_decode_k_avx2(line, 1, scale, odd);
    if constexpr (Store)
      for (int h = 0; h < 2; ++h) {  // the BF16 line of rows 8h..8h+7: (k, k + 1) per 32-bit lane
        const __m256i words = _mm256_blend_epi16(_mm256_srli_epi32(_mm256_castps_si256(even[h]), 16),
                                                 _mm256_castps_si256(odd[h]), 0xaa);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * out_stride + p * 32 + h * 16), words);
      }
  }
  KT_FP8_INLINE void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const {
    fp8_prefetch(block, p, ahead, next);
  }
};

// fp8 and fp8_perchannel: integer operations only, 12 per 32 codes against the fp16
// path's 8 + 4 two-uop vcvtph2ps (in an L1 loop on Zen 3: 16.5 against 12 GB/s of codes
// per core), then without any vpshufb (below: 9 per 32 codes, 21 against 18 GB/s in the
// same loop). Each 32-bit lane d of a line holds rows 2d (bytes 0, 1: k, k + 1) and 2d + 1
// (bytes 2, 3). A 16-bit arithmetic shift by 4 and a mask (clearing the sign's copies)
// leave the code of each word's high byte as s, eeee, mmm at bits 15, 10-7, 6-4: the high
// half of the fp32 value of w * 2^-120, exact for every code (e4m3 subnormals become fp32
// subnormals, m * 2^-129); the same after a 16-bit shift left by 8 for the low bytes. The
// high words are then fp32 values once the low words are masked off, the low words once
// shifted up: 2 + 1 + 2 + 2 + 2 operations for the 4 vectors (rows 2d and 2d + 1 at k and
// k + 1). A vector thus holds the even rows 0, 2, ..., 14 (even[0], odd[0]) or the odd rows
// (even[1], odd[1]): kSplitLanes makes the micro-kernel put its accumulators in row order
// when it loads or stores them. Store: the BF16 lines go out in that split order too (exact),
// for Bf16SplitLinesAvx2 to read. Every path of these formats multiplies w * 2^-120 (a
// format whose decode and prefill used different weight scales would round products near
// fp32's underflow differently: a token's row would depend on the path); the activation
// rows are normalized per row to 2^32 <= max |a| < 2^33 (fp8_format.h) so the products and
// sums stay normal numbers, and Fp8OpsAvx2::kSplitUnit = 2^120 restores w.
// (The first version put each code into the top byte of a 32-bit lane with a vpshufb and
// shifted by 4 in 32-bit lanes, rows 0-3 | 8-11 and 4-7 | 12-15: 12 operations, 8 of them
// on Zen 3's two shuffle and shift pipes against 5 here.)
KT_FP8_INLINE void fp8_decode_line_avx2(__m256i line, __m256 (&even)[2], __m256 (&odd)[2]) {
  const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(0x87f0));
  const __m256i high_words = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m256i odd_bytes = _mm256_and_si256(_mm256_srai_epi16(line, 4), mask);  // codes k + 1: row 2d | 2d + 1
  const __m256i even_bytes = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(line, 8), 4), mask);  // codes k
  even[0] = _mm256_castsi256_ps(_mm256_slli_epi32(even_bytes, 16));
  odd[0] = _mm256_castsi256_ps(_mm256_slli_epi32(odd_bytes, 16));
  even[1] = _mm256_castsi256_ps(_mm256_and_si256(even_bytes, high_words));
  odd[1] = _mm256_castsi256_ps(_mm256_and_si256(odd_bytes, high_words));
}

template <bool Store>
struct Fp8SplitLinesAvx2 {
  static constexpr bool kWidenInTurn = true;
  static constexpr bool kSplitLanes = true;
  static constexpr bool kOutlined = !Store;  // decode: Bf16GemmAvx2::tile
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  NextTile next;
  KT_FP8_INLINE void widen(const uint16_t* block, int b, int64_t p, __m256 (&even)[2], __m256 (&odd)[2]) const {
    const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint8_t*>(block) + p * 32));
    fp8_decode_line_avx2(line, even, odd);
    for (int h = 0; h < 2; ++h) {
      if constexpr (Store) {  // (k, k + 1) per 32-bit lane, split row order
        const __m256i words = _mm256_blend_epi16(_mm256_srli_epi32(_mm256_castps_si256(even[h]), 16),
                                                 _mm256_castps_si256(odd[h]), 0xaa);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * out_stride + p * 32 + h * 16), words);
      }
    }
  }
  KT_FP8_INLINE void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const {
    fp8_prefetch(block, p, ahead, next);
  }
};

// mxfp8 decode (one row tile, nothing stored): Fp8SplitLinesAvx2's w * 2^-120 times the
// rows' 2^(e - 7) (Fp8OpsAvx2::mx_prepare_split, split row order) = w * 2^(e - 127), the
// weight itself, exact, as the fp16 path's (w / 256) * 2^(e - 127) * 256: both paths add
// the same products in the same order (bit-identical). 2^(e - 7) is a finite fp32 only for
// e <= 134 (2^7): a k block with a larger exponent code decodes through fp16 instead.
struct Fp8MxSplitLinesAvx2 {
  static constexpr bool kWidenInTurn = true;
  static constexpr bool kSplitLanes = true;
  static constexpr bool kOutlined = true;
  static constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * kMxGroupBytesAvx2;
  const uint8_t* mx = nullptr;
  NextTile next;
  KT_FP8_INLINE void widen(const uint16_t* block, int b, int64_t p, __m256 (&even)[2], __m256 (&odd)[2]) const {
    const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint8_t*>(block) + p * 32));
    const float* scale = reinterpret_cast<const float*>(mx + b * kMxBlockBytes + (p >> 4) * kMxGroupBytesAvx2);
    fp8_decode_line_avx2(line, even, odd);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + 8 * h);
      even[h] = _mm256_mul_ps(even[h], s);
      odd[h] = _mm256_mul_ps(odd[h], s);
    }
  }
  KT_FP8_INLINE void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const {
    fp8_prefetch(block, p, ahead, next);
  }
};

// The BF16 lines Fp8SplitLinesAvx2<true> stored, read by the later row tiles.
struct Bf16SplitLinesAvx2 : Bf16LinesAvx2 {
  static constexpr bool kSplitLanes = true;
};

struct Fp8OpsAvx2 {
  using Micro = Bf16GemmAvx2;
  template <bool Mx, bool Store = false>
  using Lines = Fp8LinesAvx2<Mx, Store>;
  // fp8 and fp8_perchannel; mxfp8 decode where mx_prepare_split takes the k block's codes
  // (prefill and the other blocks keep the fp16 path: mxfp8's scales 2^-117 ... 2^119 span
  // more than fp32's range once w carries 2^-120).
  template <bool Store>
  using SplitLines = Fp8SplitLinesAvx2<Store>;
  using SplitReader = Bf16SplitLinesAvx2;
  using MxSplitLines = Fp8MxSplitLinesAvx2;
  static constexpr float kSplitUnit = 0x1p120f;
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx2;

  // 16 exponent codes e -> 2^(e - 7) (255: NaN) in split row order (rows 0, 2, ..., 14,
  // then 1, 3, ..., 15), for Fp8MxSplitLinesAvx2. False (and `out` unusable) when a code other than 255
  // is above 134, whose 2^(e - 7) fp32 cannot hold.
  static bool mx_prepare_split(const uint8_t* codes, uint8_t* out) {
    float* scale = reinterpret_cast<float*>(out);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i nan_codes = _mm_cmpeq_epi8(raw, _mm_set1_epi8(static_cast<char>(0xff)));
    const __m128i large = _mm_cmpeq_epi8(_mm_max_epu8(raw, _mm_set1_epi8(static_cast<char>(135))), raw);
    const __m128i all = _mm_shuffle_epi8(raw, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    for (int h = 0; h < 2; ++h) {
      const __m256i e = _mm256_cvtepu8_epi32(h == 0 ? all : _mm_srli_si128(all, 8));
      const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23);
      const __m256i nan = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255));
      _mm256_storeu_ps(scale + 8 * h, _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), nan)));
    }
    return _mm_movemask_epi8(_mm_andnot_si128(nan_codes, large)) == 0;
  }

  // 16 exponent codes e (in [10, 246] or 255) -> 2^(e - 127) * 256 (255: NaN), in row order.
  static void mx_prepare(const uint8_t* codes, uint8_t* out) {
    float* scale = reinterpret_cast<float*>(out);
    for (int h = 0; h < 2; ++h) {
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * h)));
      const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(8)), 23);
      const __m256i nan = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255));
      _mm256_storeu_ps(scale + 8 * h, _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), nan)));
    }
  }
};

}  // namespace
}  // namespace kt::cpu
