// [NOTE] The K-quants (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K) dotted straight from their GGUF bytes
// on AVX2 and AVX-VNNI (no decoded copy): the types of Q4_K_M / Q5_K_M / Q3_K_M / Q2_K
// files, which the avx2 variants used to decode row by row before every dot (1-token
// S1 Q4_K: 13 GB/s on Zen 3). In ggml's layout each 32-byte load of a super-block's
// level bytes gives, by a shift and a mask, the levels of 32 consecutive weights: one
// 32-weight sub-block (Q4_K, Q5_K) or two groups of 16, one per 128-bit lane (Q6_K,
// Q2_K, Q3_K). So on 256-bit registers the scales are applied in integers by vpmaddwd
// against the register's scale(s) broadcast as int16, after vpmaddubsw's pair sums
// (|.| <= 2 * 63 * 127), into one int32 sum per lane and (row, token, unit); one float
// multiply-add by d * da follows.
// Q4_K / Q5_K take the activations of the AVX-512 kernel (gguf_act.h: kGgufQ4kOrder,
// each unit's 32-63 and 64-95 swapped in each half; level sums per sub-block): the
// sub-block pairs with its activation bytes by offset, and the minimums of two rows go
// together (vpmaddwd of the rows' 6-bit minimums against the level sums), times
// dmin * da. Q5_K's fifth bits: bit r of qh[l] belongs to weight 32r + l, so each
// register's levels take one shift and AND to bring bit r to 16 (byte_bit_to), and an OR.
// Q6_K, Q2_K and Q3_K take natural-order activations with level sums per 16
// (kGgufQ6kActs): Q6_K's qh bits reach bits 4-5 by one shift and mask per register;
// Q2_K's and Q3_K's levels are bits 2r of the half's 32 qs bytes (Q3_K: + 4 where its
// hmask bit is set, one shift and AND). The offsets (Q6_K -32, Q3_K -4) are removed
// in integers as offset * sum_g scale_g * (level sum of g); Q2_K's minimums in floats.
// Each (row, activation row) result takes the same operations in the same order
// whatever the number of activation rows per pass or the row's place among the four.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../formats/gguf_types.h"
#include "gguf_decode.h"
#include "gguf_q23k_avx512.h"  // Q23k: the Q2_K / Q3_K geometry and scale unpacking (256-bit)

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// acc + vpmaddwd(pairs, scales): int16 pair sums times int16 scales into int32 lanes.
inline __m256i kquant_scaled_add(__m256i acc, __m256i pairs, __m256i scales) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales));
}

// 1 << kTo in each byte where bit `from` of the same byte of x is set, else 0: one 16-bit
// shift and one AND (a word shift by |from - kTo| < 8 brings bit `from` of each byte, and
// no bit of the other byte, to bit kTo). `from` is a constant once the callers' loops are
// unrolled. It replaced AND, compare, AND per register of Q5_K's fifth and Q3_K's third
// bits, as the even/odd scale order below replaced a vpermd per register of Q6_K, Q2_K,
// Q3_K by a vpshufd: paired A/B on Zen 3 (avx2, 2026-12-02; with gguf_rows.h's per-type
// row loop, which alone left the K-quants at 0.94-1.00), 1 / 8 tokens: S1 Q3_K 0.76 /
// 0.73 the time, Q5_K 0.92 / 0.81, Q2_K 0.90 / 0.88, Q6_K 0.92 / 0.91 (one round of five
// 1.20-1.27), Q4_K_M 0.93 / 0.95, S2 Q4_K_M 0.94 / 0.93. Same integers, same results.
template <int kTo>
inline __m256i byte_bit_to(__m256i x, int from) {
  const __m256i moved = from > kTo ? _mm256_srli_epi16(x, from - kTo) : from < kTo ? _mm256_slli_epi16(x, kTo - from) : x;
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << kTo)));
}

// Two rows' Q4_K / Q5_K headers (d, dmin, 12 scale bytes) -> per 128-bit lane (row):
// bytes 0-7 the 8 six-bit scales, bytes 8-15 the 8 six-bit minimums (ggml's
// get_scale_min_k4; lane words s0 s1 s2 = the 12 scale bytes).
inline __m256i q4k_scales_mins2(const uint8_t* row0, const uint8_t* row1) {
  const __m256i raw = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1)), 1);
  const __m256i k6k4 = _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                                         0x3f3f3f3f, 0x0f0f0f0f);
  const __m256i k2hi = _mm256_setr_epi32(0, 0x03030303, 0, 0x03030303, 0, 0x03030303, 0, 0x03030303);
  const __m256i low_shift = _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4);
  const __m256i p = _mm256_shuffle_epi32(raw, 0xED);  // s0 s2 s1 s2
  const __m256i q = _mm256_shuffle_epi32(raw, 0xA5);  // s0 s0 s1 s1
  return _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(p, low_shift), k6k4),
                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q, 6), k2hi), 4));
}

// out[4 * j + i] = dot(Q4_K row i, activation row j) for i < 4, j < M (gguf_rows.h
// passes up to kKquantAvx2Tokens), arguments as gguf_q4k_dot_rows4
// (gguf_q4k_avx512.h). kFive: Q5_K rows (176 bytes per super-block) instead of Q4_K (144).
// A unit of four rows as gguf_q4k_dot_rows4_avx2 keeps it for the next passes
// (KeptLevels): dw, sm01, sm23 (96 bytes), then per row its scale pairs lo, hi and the
// levels l0, l1 of its 4 chunks (320 bytes).
constexpr int64_t kQ4kKeptUnit = 96 + 4 * 320;

template <class Ops, int M, bool kFive = false, KeptLevels kLevels = KeptLevels::kExtract>
void gguf_q4k_dot_rows4_avx2(const uint8_t* const* rows, const int8_t* const* aq, const float* const* scale4,
                             const int16_t* const* level_sums, int64_t units, bool prefetch, float* out,
                             uint8_t* cache = nullptr) {
  constexpr int64_t kBytes = kFive ? 176 : 144;  // per super-block
  constexpr int64_t kQs = kFive ? 48 : 16;       // offset of the nibbles
  // Sub-block r's activation bytes in kGgufQ4kOrder.
  constexpr int kActAt[8] = {0, 64, 32, 96, 128, 192, 160, 224};
  const __m256i low = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
  __m256 acc[M][4], accm[M];
  for (int j = 0; j < M; ++j) {
    accm[j] = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
  }
  for (int64_t u = 0; u < units; ++u) {
    uint8_t* kept = kLevels == KeptLevels::kExtract ? nullptr : cache + u * kQ4kKeptUnit;
    const auto kept_reg = [&](int64_t at) { return reinterpret_cast<__m256i*>(kept + at); };
    const uint8_t* b[4];
    for (int i = 0; i < 4; ++i) b[i] = rows[i] + u * kBytes;
    __m256 dw;  // [d0 dmin0 d1 dmin1 d2 dmin2 d3 dmin3]
    __m256i sm01, sm23;
    if constexpr (kLevels == KeptLevels::kLoad) {
      dw = _mm256_load_ps(reinterpret_cast<const float*>(kept));
      sm01 = _mm256_load_si256(kept_reg(32));
      sm23 = _mm256_load_si256(kept_reg(64));
    } else {
      uint32_t first[4];
      for (int i = 0; i < 4; ++i) std::memcpy(&first[i], b[i], 4);
      dw = _mm256_cvtph_ps(_mm_setr_epi32(static_cast<int>(first[0]), static_cast<int>(first[1]),
                                          static_cast<int>(first[2]), static_cast<int>(first[3])));
      sm01 = q4k_scales_mins2(b[0], b[1]);
      sm23 = q4k_scales_mins2(b[2], b[3]);
      if constexpr (kLevels == KeptLevels::kKeep) {
        _mm256_store_ps(reinterpret_cast<float*>(kept), dw);
        _mm256_store_si256(kept_reg(32), sm01);
        _mm256_store_si256(kept_reg(64), sm23);
      }
    }
    __m256 d[M];
    for (int j = 0; j < M; ++j) {
      d[j] = _mm256_mul_ps(dw, _mm256_set1_ps(scale4[j][u * 64]));
      // Minimums of rows 0-1 (2-3) per lane times the 8 sub-blocks' level sums, then
      // lanes [row 0: 2, row 2: 2 | row 1: 2, row 3: 2] times their dmin * da.
      const __m256i sums = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(level_sums[j] + u * 16 + 8)));
      const __m256i m = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi8(sm01, zero), sums),
                                          _mm256_madd_epi16(_mm256_unpackhi_epi8(sm23, zero), sums));
      accm[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m),
                                _mm256_permutevar8x32_ps(d[j], _mm256_setr_epi32(1, 1, 5, 5, 3, 3, 7, 7)), accm[j]);
    }
    // Each row's scales as int16 pairs (s, s): dwords s0-s3 (lo) and s4-s7 (hi) per lane.
    const __m256i sc01 = _mm256_unpacklo_epi8(sm01, zero), sc23 = _mm256_unpacklo_epi8(sm23, zero);
    const __m256i pairs_lo[2] = {_mm256_unpacklo_epi16(sc01, sc01), _mm256_unpacklo_epi16(sc23, sc23)};
    const __m256i pairs_hi[2] = {_mm256_unpackhi_epi16(sc01, sc01), _mm256_unpackhi_epi16(sc23, sc23)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int64_t row_at = 96 + 320 * i;  // this row's kept scale pairs and levels
      __m256i lo, hi, qh = zero;
      if constexpr (kLevels == KeptLevels::kLoad) {
        lo = _mm256_load_si256(kept_reg(row_at));
        hi = _mm256_load_si256(kept_reg(row_at + 32));
      } else {
        if (prefetch) gguf_prefetch_ahead(b[i], kBytes);
        lo = i % 2 != 0 ? _mm256_permute2x128_si256(pairs_lo[i / 2], pairs_lo[i / 2], 0x11)
                        : _mm256_permute2x128_si256(pairs_lo[i / 2], pairs_lo[i / 2], 0x00);
        hi = i % 2 != 0 ? _mm256_permute2x128_si256(pairs_hi[i / 2], pairs_hi[i / 2], 0x11)
                        : _mm256_permute2x128_si256(pairs_hi[i / 2], pairs_hi[i / 2], 0x00);
        if constexpr (kFive) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i] + 16));
        if constexpr (kLevels == KeptLevels::kKeep) {
          _mm256_store_si256(kept_reg(row_at), lo);
          _mm256_store_si256(kept_reg(row_at + 32), hi);
        }
      }
      __m256i t[M];
      for (int j = 0; j < M; ++j) t[j] = zero;
      // Sub-blocks 2c (low nibbles) and 2c + 1 (high); c a constant for the immediates.
      const auto chunk = [&](auto chunk_index) {
        constexpr int c = decltype(chunk_index)::value;
        __m256i l0, l1;
        if constexpr (kLevels == KeptLevels::kLoad) {
          l0 = _mm256_load_si256(kept_reg(row_at + 64 + 64 * c));
          l1 = _mm256_load_si256(kept_reg(row_at + 96 + 64 * c));
        } else {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i] + kQs + 32 * c));
          l0 = _mm256_and_si256(q, low);
          l1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
          if constexpr (kFive) {  // bits 2c, 2c + 1 of qh: + 16
            l0 = _mm256_or_si256(l0, byte_bit_to<4>(qh, 2 * c));
            l1 = _mm256_or_si256(l1, byte_bit_to<4>(qh, 2 * c + 1));
          }
          if constexpr (kLevels == KeptLevels::kKeep) {
            _mm256_store_si256(kept_reg(row_at + 64 + 64 * c), l0);
            _mm256_store_si256(kept_reg(row_at + 96 + 64 * c), l1);
          }
        }
        const __m256i src = c < 2 ? lo : hi;
        const __m256i s0 = _mm256_shuffle_epi32(src, (2 * c % 4) * 0x55);
        const __m256i s1 = _mm256_shuffle_epi32(src, ((2 * c + 1) % 4) * 0x55);
        for (int j = 0; j < M; ++j) {
          const int8_t* a = aq[j] + u * 256;
          const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kActAt[2 * c]));
          const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kActAt[2 * c + 1]));
          t[j] = kquant_scaled_add(t[j], _mm256_maddubs_epi16(l0, a0), s0);
          t[j] = kquant_scaled_add(t[j], _mm256_maddubs_epi16(l1, a1), s1);
        }
      };
      chunk(std::integral_constant<int, 0>{});
      chunk(std::integral_constant<int, 1>{});
      chunk(std::integral_constant<int, 2>{});
      chunk(std::integral_constant<int, 3>{});
      for (int j = 0; j < M; ++j)
        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[j]),
                                    _mm256_permutevar8x32_ps(d[j], _mm256_set1_epi32(2 * i)), acc[j][i]);
    }
  }
  for (int j = 0; j < M; ++j) {
    alignas(32) float minimums[8];
    _mm256_store_ps(minimums, accm[j]);
    constexpr int kMinLane[4] = {0, 4, 2, 6};  // row i's two lanes of accm
    for (int i = 0; i < 4; ++i)
      out[4 * j + i] = Ops::Vec::reduce_add(acc[j][i]) - (minimums[kMinLane[i]] + minimums[kMinLane[i] + 1]);
  }
}

// out[4 * j + i] = dot(row i, activation row j) for i < 4, j < M, kType Q6_K, Q2_K or
// Q3_K (16 groups of 16 weights per unit), arguments as gguf_q6k_dot_rows4
// (gguf_q6k_avx512.h), whose activations (natural order, level sums of 16) they take.
// A unit's row as gguf_group16_dot_rows4_avx2 keeps it for the next passes (KeptLevels):
// the levels v (8 x 32 bytes), the groups' scale pairs per register s (8 x 32), sc, the
// minimums (Q2_K) and d, dmin.
constexpr int64_t kGroup16Kept = 640;

template <class Ops, GgmlType kType, int M, KeptLevels kLevels = KeptLevels::kExtract>
void gguf_group16_dot_rows4_avx2(const uint8_t* const* rows, const int8_t* const* aq, const float* const* scale4,
                                 const int16_t* const* level_sums, int64_t units, bool prefetch, float* out,
                                 uint8_t* cache = nullptr) {
  static_assert(kType == GgmlType::kQ6_K || kType == GgmlType::kQ2_K || kType == GgmlType::kQ3_K);
  constexpr bool kSix = kType == GgmlType::kQ6_K, kThree = kType == GgmlType::kQ3_K;
  constexpr int64_t kBytes = kSix ? 210 : Q23k<kType>::kBytes;
  const __m256i low = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
  const __m256i three = _mm256_set1_epi8(3);
  // Per 128-bit lane of int16 scales: the even groups first, then the odd ones (vpshufb).
  const __m256i even_odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  __m256 acc[M][4];
  for (int j = 0; j < M; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * kBytes;
      uint8_t* kept = kLevels == KeptLevels::kExtract ? nullptr : cache + (u * 4 + i) * kGroup16Kept;
      const auto kept_reg = [&](int64_t at) { return reinterpret_cast<__m256i*>(kept + at); };
      // The 16 groups' scales as int16 (Q2_K: and minimums); as pairs (s, s), the even
      // groups in lane 0 and the odd ones in lane 1: P = s0 s2 s4 s6 | s1 s3 s5 s7,
      // Q = s8 s10 s12 s14 | s9 s11 s13 s15, so each register's two scales are one
      // in-lane vpshufd away (vpermd per register before).
      __m256i sc = _mm256_setzero_si256(), minimums = sc, P = sc, Q = sc;
      float d, dmin = 0.0f;
      __m256i hmask = _mm256_setzero_si256();
      if constexpr (kLevels == KeptLevels::kLoad) {
        sc = _mm256_load_si256(kept_reg(512));
        if constexpr (kType == GgmlType::kQ2_K) minimums = _mm256_load_si256(kept_reg(544));
        std::memcpy(&d, kept + 576, 4);
        std::memcpy(&dmin, kept + 580, 4);
      } else {
        if (prefetch) gguf_prefetch_ahead(b, kBytes);
        if constexpr (kSix) {
          sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
          d = gguf_f16(b + 208);
        } else {
          Q23k<kType>::scales(b, sc, minimums);
          d = Q23k<kType>::d(b);
          dmin = Q23k<kType>::dmin(b);
        }
        // [s0 s2 s4 s6 s1 s3 s5 s7 | s8 s10 .. s9 s11 ..] -> [s0 s2 .. s14 | s1 s3 .. s15]
        const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(sc, even_odd), 0xD8);
        P = _mm256_unpacklo_epi16(split, split);
        Q = _mm256_unpackhi_epi16(split, split);
        if constexpr (kThree) hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
        if constexpr (kLevels == KeptLevels::kKeep) {
          _mm256_store_si256(kept_reg(512), sc);
          _mm256_store_si256(kept_reg(544), minimums);
          std::memcpy(kept + 576, &d, 4);
          std::memcpy(kept + 580, &dmin, 4);
        }
      }
      __m256i t[M];
      for (int j = 0; j < M; ++j) t[j] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {  // halves of 128 weights
        // v[r]: levels of weights 128n + 32r .. + 31 (groups 8n + 2r, + 1).
        __m256i v[4];
        if constexpr (kLevels == KeptLevels::kLoad) {
          for (int r = 0; r < 4; ++r) v[r] = _mm256_load_si256(kept_reg(32 * (4 * n + r)));
        } else if constexpr (kSix) {  // ql low nibbles, high nibbles; qh bits 2r, 2r + 1 to bits 4-5
          const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));
          const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));
          const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
          v[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi16(H, 4), bits45));
          v[1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi16(H, 2), bits45));
          v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low), _mm256_and_si256(H, bits45));
          v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                                 _mm256_and_si256(_mm256_srli_epi16(H, 2), bits45));
        } else {  // bits 2r..2r + 1 of qs[32n + l] (Q3_K: + 4 where hmask bit 4n + r is set)
          const __m256i qs =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Q23k<kType>::kQs + 32 * n));
          v[0] = _mm256_and_si256(qs, three);
          v[1] = _mm256_and_si256(_mm256_srli_epi16(qs, 2), three);
          v[2] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), three);
          v[3] = _mm256_and_si256(_mm256_srli_epi16(qs, 6), three);
          if constexpr (kThree)
            for (int r = 0; r < 4; ++r) v[r] = _mm256_or_si256(v[r], byte_bit_to<2>(hmask, 4 * n + r));
        }
        if constexpr (kLevels == KeptLevels::kKeep)
          for (int r = 0; r < 4; ++r) _mm256_store_si256(kept_reg(32 * (4 * n + r)), v[r]);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          __m256i s;
          if constexpr (kLevels == KeptLevels::kLoad) {
            s = _mm256_load_si256(kept_reg(256 + 32 * (4 * n + r)));
          } else {
            const __m256i half = n == 0 ? P : Q;  // dword r of each lane (immediates at any -O)
            s = r == 0   ? _mm256_shuffle_epi32(half, 0x00)
                : r == 1 ? _mm256_shuffle_epi32(half, 0x55)
                : r == 2 ? _mm256_shuffle_epi32(half, 0xAA)
                         : _mm256_shuffle_epi32(half, 0xFF);
            if constexpr (kLevels == KeptLevels::kKeep) _mm256_store_si256(kept_reg(256 + 32 * (4 * n + r)), s);
          }
          for (int j = 0; j < M; ++j) {
            const __m256i a =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq[j] + u * 256 + 128 * n + 32 * r));
            t[j] = kquant_scaled_add(t[j], _mm256_maddubs_epi16(v[r], a), s);
          }
        }
      }
      for (int j = 0; j < M; ++j) {
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(level_sums[j] + u * 16));
        const float da = scale4[j][u * 64];
        if constexpr (kType == GgmlType::kQ2_K) {  // minimums in floats, as on AVX-512
          const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(minimums, sums));
          acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[j]), _mm256_set1_ps(d * da), acc[j][i]);
          acc[j][i] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(dmin * da), acc[j][i]);
        } else {  // the offset (Q6_K 32, Q3_K 4) times sum_g scale_g * sum_g, in integers
          const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc, sums), kSix ? 5 : 2);
          acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(t[j], offset)), _mm256_set1_ps(d * da),
                                      acc[j][i]);
        }
      }
    }
  }
  for (int j = 0; j < M; ++j)
    for (int i = 0; i < 4; ++i) out[4 * j + i] = Ops::Vec::reduce_add(acc[j][i]);
}

}  // namespace
}  // namespace kt::cpu
