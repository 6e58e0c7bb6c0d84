// [NOTE] K-quant prefill on AVX-512 (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): an integer tile GEMM
// over rows repacked once per call. The in-place kernels (gguf_q4k_avx512.h,
// gguf_q6k_avx512.h, gguf_q23k_avx512.h) dot one row
// with one token at a time and widen through int16 (vpmaddubsw, then vpdpwssd by the
// sub-block scale: two instructions per 64 products, plus a horizontal sum per row, token
// and unit). With many tokens per expert the rows are worth repacking: each group of 16
// rows becomes, per unit (256 k), 64 lines of [16 rows][4 k] level bytes (the BF16 / INT8
// line shape, k in the activations' order), the integer sub-block scales per row, int16
// pairs for the minimums (Q4_K, Q5_K, Q2_K) or the level offset (Q6_K: -32, Q3_K: -4), and
// d (dmin) per row. Then per token and sub-block (32 or 16 k) 8 or 4 vpdpbusd give 16 rows' int32
// sums, and one vpmulld by the rows' scales adds them to the unit sum S_u; the minimums'
// (offset's) sum M_u takes 4 (8) vpdpwssd per unit. No horizontal sums. The integers and
// the float operations on them are the in-place kernels':
//   Q4_K / Q5_K / Q2_K: acc = fma(float(S_u), d * da, acc), accm = fma(float(M_u), dmin * da, accm), acc - accm
//   Q6_K (Q3_K):        acc = fma(float(S_u - 32 M_u), d * da, acc)  (4 M_u)
// so a token's result has the same bits on either path (gguf_rows picks by the expert's
// token count; batch invariance holds).
// Bounds: Q4_K/Q5_K levels <= 31, scales <= 63, |a| <= 127: |S_u| <= 256 * 31 * 127 * 63
// < 2^31; Q6_K levels <= 63, |scale| <= 128: |S_u| <= 256 * 63 * 127 * 128 < 2^31 (Q2_K,
// Q3_K: levels <= 7, scales <= 32, far below).
// Include only from a variant translation unit, after its target pragma.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_act.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kKquantTileRows = 16;   // rows per repacked group (one register of outputs)
// Tokens per pass over a repacked group (registers). Passes of 5 or 6 (a C++ harness of
// S1's Q4_K matrices, 32 tokens per expert, Zen 5, 2026-12-02) took 0.96-1.01x the time:
// the 8 chains of 8 vpdpbusd per sub-block are not what bounds it. That harness's tile
// alone ran 4.8-5.5 vpdpbusd per ns (7.7 the core's peak) and the Q4_K repack cost 6.6 ns
// per 16 rows x 32 k (one core, L2).
constexpr int kKquantTileTokens = 4;
// Tokens of one expert from which gguf_rows repacks its rows (K-quants, block-32 types; either path gives
// the same bits, so the choice may follow the call).
constexpr int64_t kKquantTileMinPairs = 8;

// One unit (256 k) of a group of 16 rows, repacked (5760 bytes).
struct alignas(64) KquantTileUnit {
  uint8_t levels[64][64];  // line l: k 4 l .. 4 l + 3 (activation order) of row r at bytes 4 r .. 4 r + 3
  int32_t scale[16][16];   // sub-block chunk c of the line order (Q4_K: 32 k, Q6_K: 16 k): its scale, per row
  int32_t pairs[8][16];    // int16 pairs per row: (min[2 p], min[2 p + 1]) (Q4_K, natural sub-block
                           // order) or (scale[2 p], scale[2 p + 1]) (Q6_K)
  float d[16], dmin[16];
};

// The repacked kinds: sub-blocks per unit, int16 pairs per row, where the activation's
// level sums of the pairs start in a unit's 16, and the offset's shift (0: minimums).
enum class KquantTile { kQ4k, kQ5k, kQ6k, kQ2k, kQ3k };
template <KquantTile K>
struct KquantTileKind {
  static constexpr bool kGroups16 = K == KquantTile::kQ6k || K == KquantTile::kQ2k || K == KquantTile::kQ3k;
  static constexpr int kSubs = kGroups16 ? 16 : 8;
  static constexpr int kLinesPerSub = 64 / kSubs;
  static constexpr int kPairs = kGroups16 ? 8 : 4;
  static constexpr int kPairsAt = kGroups16 ? 0 : 8;  // gguf_act.h: Q4_K's level sums follow 8 zeros
  // The offset's shift: Q6_K - 32 sum_g scale_g levelsum_g, Q3_K - 4 ...; 0: minimums (dmin).
  static constexpr int kOffsetShift = K == KquantTile::kQ6k ? 5 : K == KquantTile::kQ3k ? 2 : 0;
};

// The natural sub-block of 32-k chunk c in kGgufQ4kOrder.
constexpr int kQ4kChunkSub[8] = {0, 2, 1, 3, 4, 6, 5, 7};

// x[i] (i < 4) int32 word c of a 128-bit lane -> y[c] word i of that lane: a 4 x 4
// transpose within each of the four lanes.
inline void transpose4x4_lanes_epi32(const __m512i& x0, const __m512i& x1, const __m512i& x2, const __m512i& x3,
                                     __m512i* y) {
  const __m512i t0 = _mm512_unpacklo_epi32(x0, x1), t1 = _mm512_unpackhi_epi32(x0, x1);
  const __m512i t2 = _mm512_unpacklo_epi32(x2, x3), t3 = _mm512_unpackhi_epi32(x2, x3);
  y[0] = _mm512_unpacklo_epi64(t0, t2);
  y[1] = _mm512_unpackhi_epi64(t0, t2);
  y[2] = _mm512_unpacklo_epi64(t1, t3);
  y[3] = _mm512_unpackhi_epi64(t1, t3);
}

// r[i] int32 lane c -> r[c] int32 lane i (a 16 x 16 transpose).
inline void transpose16x16_epi32(__m512i (&r)[16]) {
  __m512i u[16];
  for (int i = 0; i < 4; ++i)  // lane L of u[4 i + c]: column 4 L + c of rows 4 i .. 4 i + 3
    transpose4x4_lanes_epi32(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3], u + 4 * i);
  for (int e = 0; e < 4; ++e) {  // the 128-bit lanes of the four row groups
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// The next unit's bytes of 16 rows to L1 (from L2, where the span's stream brought them).
template <int64_t kBytes>
inline void kquant_tile_prefetch_unit(const uint8_t* const* rows, int64_t u, int64_t units) {
  if (u + 1 >= units) return;
  for (int r = 0; r < kKquantTileRows; ++r)
    for (int64_t line = 0; line < kBytes + 63; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + (u + 1) * kBytes + line), _MM_HINT_T0);
}

// t.pairs[p] = the int16 pair (v[2 p], v[2 p + 1]) per row (values that fit int16).
template <int kPairs>
inline void kquant_tile_pairs(const __m512i* v, KquantTileUnit& t) {
  for (int p = 0; p < kPairs; ++p)
    _mm512_store_si512(t.pairs[p], _mm512_or_si512(_mm512_and_si512(v[2 * p], _mm512_set1_epi32(0xffff)),
                                                   _mm512_slli_epi32(v[2 * p + 1], 16)));
}

// f16 values at byte `at` of each of 16 rows' unit u (kBytes per super-block) -> fp32.
template <int64_t kBytes>
inline __m512 kquant_tile_f16(const uint8_t* const* rows, int64_t u, int64_t at) {
  alignas(32) uint16_t h[16];
  for (int r = 0; r < kKquantTileRows; ++r) std::memcpy(&h[r], rows[r] + u * kBytes + at, 2);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

// The four int32 words at byte `at` of 16 rows: w[q] lane r = word q of row r.
inline void kquant_tile_words(const uint8_t* const* rows, int64_t at, __m512i& w0, __m512i& w1, __m512i& w2,
                              __m512i& w3) {
  __m512i head[4];  // rows 4 i .. 4 i + 3, one per 128-bit lane
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * i] + at)));
    for (int l = 1; l < 4; ++l)
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * i + l] + at)), l);
    head[i] = v;
  }
  __m512i y[4];
  transpose4x4_lanes_epi32(head[0], head[1], head[2], head[3], y);
  // After the 4 x 4 transposes within the 128-bit lanes, lane 4 L + i holds row 4 i + L.
  const __m512i row_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  w0 = _mm512_permutexvar_epi32(row_order, y[0]);
  w1 = _mm512_permutexvar_epi32(row_order, y[1]);
  w2 = _mm512_permutexvar_epi32(row_order, y[2]);
  w3 = _mm512_permutexvar_epi32(row_order, y[3]);
}

// 16 rows (pointers to their first super-block; a group's rows past the matrix repeat its
// last row) -> `units` repacked units. kFive: Q5_K rows (176 bytes per super-block).
// The headers (d | dmin, then 12 bytes of 6-bit scales and minimums) are transposed to
// one word per row and lane, so ggml's get_scale_min_k4 runs on 16 rows at once; the
// nibbles are transposed as bytes (one 16 x 16 int32 transpose per 64 bytes of each row)
// and split into levels afterwards.
template <bool kFive>
void kquant_tile_repack_q4k(const uint8_t* const* rows, int64_t units, KquantTileUnit* out) {
  constexpr int64_t kBytes = kFive ? 176 : 144;
  constexpr int64_t kQs = kFive ? 48 : 16;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i sixteen = _mm512_set1_epi8(16);
  const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(0x0f), high2 = _mm512_set1_epi32(0x30);
  // Q5_K: the qh bit of level register g's (see gguf_q4k_dot_rows4) low / high 32 bytes.
  constexpr uint8_t kFifthBit[4][2] = {{1, 4}, {2, 8}, {16, 64}, {32, 128}};
  for (int64_t u = 0; u < units; ++u) {
    kquant_tile_prefetch_unit<kBytes>(rows, u, units);
    KquantTileUnit& t = out[u];
    __m512i w0, w1, w2, w3;  // word w of the 16 rows' headers, lane r = row r
    kquant_tile_words(rows, u * kBytes, w0, w1, w2, w3);  // d | dmin << 16, scale bytes 0-3, 4-7, 8-11
    _mm512_store_ps(t.d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0)));
    _mm512_store_ps(t.dmin, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16))));
    __m512i sc[8], mn[8];
    for (int j = 0; j < 4; ++j) {
      sc[j] = _mm512_and_si512(_mm512_srli_epi32(w1, 8 * j), six);
      mn[j] = _mm512_and_si512(_mm512_srli_epi32(w2, 8 * j), six);
      sc[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w3, 8 * j), four),
                                  _mm512_and_si512(_mm512_srli_epi32(w1, 8 * j + 2), high2));
      mn[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w3, 8 * j + 4), four),
                                  _mm512_and_si512(_mm512_srli_epi32(w2, 8 * j + 2), high2));
    }
    for (int c = 0; c < 8; ++c) _mm512_store_si512(t.scale[c], sc[kQ4kChunkSub[c]]);
    kquant_tile_pairs<4>(mn, t);
    __m512i qh[16];
    if constexpr (kFive) {  // word w of the rows' fifth bits: bytes 4 w .. 4 w + 3 of qh
      for (int r = 0; r < kKquantTileRows; ++r)
        qh[r] = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + u * kBytes + 16)));
      transpose16x16_epi32(qh);
    }
    for (int h = 0; h < 2; ++h) {  // nibble bytes 64 h .. 64 h + 63 of every row
      __m512i v[16];
      for (int r = 0; r < kKquantTileRows; ++r) v[r] = _mm512_loadu_si512(rows[r] + u * kBytes + kQs + 64 * h);
      transpose16x16_epi32(v);
      for (int c = 0; c < 16; ++c) {
        // Low nibbles: level register g = 2 h, high: 2 h + 1; line 16 g + c.
        __m512i lo = _mm512_and_si512(v[c], low), hi = _mm512_and_si512(_mm512_srli_epi16(v[c], 4), low);
        if constexpr (kFive) {
          const __m512i bits = qh[c % 8];
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits, _mm512_set1_epi8(static_cast<char>(kFifthBit[2 * h][c / 8]))),
                                    lo, sixteen);
          hi = _mm512_mask_add_epi8(
              hi, _mm512_test_epi8_mask(bits, _mm512_set1_epi8(static_cast<char>(kFifthBit[2 * h + 1][c / 8]))), hi,
              sixteen);
        }
        _mm512_store_si512(t.levels[32 * h + c], lo);
        _mm512_store_si512(t.levels[32 * h + 16 + c], hi);
      }
    }
  }
}

// Q6_K: 16 rows -> `units` repacked units (210 bytes per super-block: ql[128], qh[64],
// scales[16] int8, d). The ql and qh bytes are transposed (one 16 x 16 int32 transpose per
// 64 bytes) and line l takes its nibble and its two high bits from them: weight k = 4 l
// is in half h = k / 128 at x = k % 128, nibble x / 64 of ql byte 64 h + x % 64 and bits
// 2 (x / 32) of qh byte 32 h + x % 32 (gguf_q6k_dot_rows4's layout).
inline void kquant_tile_repack_q6k(const uint8_t* const* rows, int64_t units, KquantTileUnit* out) {
  constexpr int64_t kBytes = 210;
  const __m512i low = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  for (int64_t u = 0; u < units; ++u) {
    kquant_tile_prefetch_unit<kBytes>(rows, u, units);
    KquantTileUnit& t = out[u];
    __m512i w[4];  // scale bytes 4 q .. 4 q + 3 of each row
    kquant_tile_words(rows, u * kBytes + 192, w[0], w[1], w[2], w[3]);
    __m512i sc[16];
    for (int g = 0; g < 16; ++g)
      sc[g] = _mm512_srai_epi32(_mm512_slli_epi32(w[g / 4], 24 - 8 * (g % 4)), 24);  // int8 -> int32
    for (int g = 0; g < 16; ++g) _mm512_store_si512(t.scale[g], sc[g]);
    kquant_tile_pairs<8>(sc, t);
    _mm512_store_ps(t.d, kquant_tile_f16<kBytes>(rows, u, 208));
    _mm512_store_ps(t.dmin, _mm512_setzero_ps());
    alignas(64) int32_t qh_words[16][16];  // transposed qh, through L1 (32 registers would spill)
    {
      __m512i qh[16];
      for (int r = 0; r < kKquantTileRows; ++r) qh[r] = _mm512_loadu_si512(rows[r] + u * kBytes + 128);
      transpose16x16_epi32(qh);
      for (int w = 0; w < 16; ++w) _mm512_store_si512(qh_words[w], qh[w]);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i ql[16];
      for (int r = 0; r < kKquantTileRows; ++r) ql[r] = _mm512_loadu_si512(rows[r] + u * kBytes + 64 * h);
      transpose16x16_epi32(ql);
      for (int x = 0; x < 32; ++x) {  // line 32 h + x
        const __m512i nib = x < 16 ? _mm512_and_si512(ql[x], low) : _mm512_and_si512(_mm512_srli_epi16(ql[x - 16], 4), low);
        const __m512i bits = _mm512_load_si512(qh_words[8 * h + x % 8]);
        __m512i top;
        switch (x / 8) {  // bits 2 s .. 2 s + 1 to bits 4-5 (16-bit shifts: what crosses bytes is masked)
          case 0: top = _mm512_slli_epi16(bits, 4); break;
          case 1: top = _mm512_slli_epi16(bits, 2); break;
          case 2: top = bits; break;
          default: top = _mm512_srli_epi16(bits, 2); break;
        }
        _mm512_store_si512(t.levels[32 * h + x], _mm512_or_si512(nib, _mm512_and_si512(top, bits45)));
      }
    }
  }
}

// Q2_K (84 bytes: scales[16] (low nibble scale, high nibble minimum), qs[64], d, dmin) and
// Q3_K (110 bytes: hmask[32], qs[64], scales[12] (6 bits - 32), d): 16 rows -> `units`
// repacked units. Weight 128 n + 32 j + l is bits 2 j .. 2 j + 1 of qs[32 n + l] (Q3_K: + 4
// where bit 4 n + j of hmask[l] is set), so line L (k = 4 L) takes transposed qs word
// 8 n + L % 8 shifted by 2 j (and hmask word L % 8), n = L / 32, j = L % 32 / 8.
template <bool kThree>
void kquant_tile_repack_q23k(const uint8_t* const* rows, int64_t units, KquantTileUnit* out) {
  constexpr int64_t kBytes = kThree ? 110 : 84;
  constexpr int64_t kQs = kThree ? 32 : 16;
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), nibble = _mm512_set1_epi32(0x0f);
  for (int64_t u = 0; u < units; ++u) {
    kquant_tile_prefetch_unit<kBytes>(rows, u, units);
    KquantTileUnit& t = out[u];
    __m512i sc[16], mn[16];
    if constexpr (kThree) {
      __m512i w[4];  // bytes 92 .. 107: w[1..3] = scale bytes 0-3, 4-7, 8-11 (in the block)
      kquant_tile_words(rows, u * kBytes + 92, w[0], w[1], w[2], w[3]);
      for (int g = 0; g < 16; ++g) {
        const int b = g % 8;  // ggml: low 4 bits of byte g (g < 8) or high 4 of byte g - 8
        const __m512i low4 = _mm512_and_si512(_mm512_srli_epi32(w[1 + b / 4], 8 * (b % 4) + (g < 8 ? 0 : 4)), nibble);
        const __m512i high2 =
            _mm512_and_si512(_mm512_srli_epi32(w[3], 8 * (g % 4) + 2 * (g / 4)), _mm512_set1_epi32(3));
        sc[g] = _mm512_sub_epi32(_mm512_or_si512(low4, _mm512_slli_epi32(high2, 4)), _mm512_set1_epi32(32));
      }
      kquant_tile_pairs<8>(sc, t);
      _mm512_store_ps(t.d, kquant_tile_f16<kBytes>(rows, u, 108));
      _mm512_store_ps(t.dmin, _mm512_setzero_ps());
    } else {
      __m512i w[4];  // scale bytes 4 q .. 4 q + 3
      kquant_tile_words(rows, u * kBytes, w[0], w[1], w[2], w[3]);
      for (int g = 0; g < 16; ++g) {
        sc[g] = _mm512_and_si512(_mm512_srli_epi32(w[g / 4], 8 * (g % 4)), nibble);
        mn[g] = _mm512_and_si512(_mm512_srli_epi32(w[g / 4], 8 * (g % 4) + 4), nibble);
      }
      kquant_tile_pairs<8>(mn, t);
      _mm512_store_ps(t.d, kquant_tile_f16<kBytes>(rows, u, 80));
      _mm512_store_ps(t.dmin, kquant_tile_f16<kBytes>(rows, u, 82));
    }
    for (int g = 0; g < 16; ++g) _mm512_store_si512(t.scale[g], sc[g]);
    alignas(64) int32_t hmask_words[8][16];
    if constexpr (kThree) {
      __m512i h[16];
      for (int r = 0; r < kKquantTileRows; ++r)
        h[r] = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + u * kBytes)));
      transpose16x16_epi32(h);
      for (int w = 0; w < 8; ++w) _mm512_store_si512(hmask_words[w], h[w]);
    }
    __m512i qs[16];
    for (int r = 0; r < kKquantTileRows; ++r) qs[r] = _mm512_loadu_si512(rows[r] + u * kBytes + kQs);
    transpose16x16_epi32(qs);
    for (int line = 0; line < 64; ++line) {
      const int n = line / 32, j = line % 32 / 8;
      __m512i level = _mm512_and_si512(_mm512_srli_epi16(qs[8 * n + line % 8], 2 * j), three);
      if constexpr (kThree) {
        const __m512i bits = _mm512_load_si512(hmask_words[line % 8]);
        level = _mm512_mask_add_epi8(level, _mm512_test_epi8_mask(bits, _mm512_set1_epi8(static_cast<char>(1 << (4 * n + j)))),
                                     level, four);
      }
      _mm512_store_si512(t.levels[line], level);
    }
  }
}

// G repacked groups (group g's units at w + g * units; rows r < rows[g]) dotted with T
// activation rows: out[j] + 16 g + r = dot(row r of group g, activation row j); aq[j],
// scale4[j], level_sums[j] as the in-place kernels'. Per 4-k line, G weight loads and T
// broadcasts feed G * T vpdpbusd; the sub-block sums (G * T registers) go to the unit
// sums (G * T registers) by one vpmulld each; the fp32 accumulators live in L1 (touched
// once per unit).
template <class Ops, KquantTile K, int G, int T>
void kquant_tile_gemm(const KquantTileUnit* w, int64_t units, const int8_t* const* aq, const float* const* scale4,
                      const int16_t* const* level_sums, float* const* out, const int* rows, const char* stream,
                      int64_t stream_lines) {
  using Kind = KquantTileKind<K>;
  // `stream_lines` lines from `stream` to L2, spread over the sub-block iterations (a burst
  // of prefetches stalls on the miss buffers).
  const int64_t per_step = (stream_lines + units * Kind::kSubs - 1) / (units * Kind::kSubs);
  int64_t streamed = 0;
  alignas(64) float acc[G][T][16], accm[G][T][16];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < T; ++j) {
      _mm512_store_ps(acc[g][j], _mm512_setzero_ps());
      _mm512_store_ps(accm[g][j], _mm512_setzero_ps());
    }
  for (int64_t u = 0; u < units; ++u) {
    __m512i s[G][T];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < T; ++j) s[g][j] = _mm512_setzero_si512();
    for (int c = 0; c < Kind::kSubs; ++c) {
      for (const int64_t end = std::min(stream_lines, streamed + per_step); streamed < end; ++streamed)
        _mm_prefetch(stream + streamed * 64, _MM_HINT_T1);
      __m512i v[G][T];
      for (int l = 0; l < Kind::kLinesPerSub; ++l) {
        const int line = Kind::kLinesPerSub * c + l;
        __m512i a[T];
        for (int j = 0; j < T; ++j) {
          int32_t word;
          std::memcpy(&word, aq[j] + u * 256 + 4 * line, 4);
          a[j] = _mm512_set1_epi32(word);
        }
        for (int g = 0; g < G; ++g) {
          const __m512i levels = _mm512_load_si512(w[g * units + u].levels[line]);
          for (int j = 0; j < T; ++j) v[g][j] = Ops::dot(l == 0 ? _mm512_setzero_si512() : v[g][j], levels, a[j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512i scale = _mm512_load_si512(w[g * units + u].scale[c]);
        for (int j = 0; j < T; ++j) s[g][j] = _mm512_add_epi32(s[g][j], _mm512_mullo_epi32(v[g][j], scale));
      }
    }
    for (int j = 0; j < T; ++j) {
      __m512i pairs[Kind::kPairs];
      for (int p = 0; p < Kind::kPairs; ++p) {
        int32_t pair;
        std::memcpy(&pair, level_sums[j] + u * 16 + Kind::kPairsAt + 2 * p, 4);
        pairs[p] = _mm512_set1_epi32(pair);
      }
      const __m512 da = _mm512_set1_ps(scale4[j][u * 64]);
      for (int g = 0; g < G; ++g) {
        const KquantTileUnit& t = w[g * units + u];
        __m512i m = _mm512_setzero_si512();
        for (int p = 0; p < Kind::kPairs; ++p) m = Ops::dot16(m, _mm512_load_si512(t.pairs[p]), pairs[p]);
        const __m512 d = _mm512_mul_ps(_mm512_load_ps(t.d), da);
        if constexpr (Kind::kOffsetShift > 0) {
          const __m512i total = _mm512_sub_epi32(s[g][j], _mm512_slli_epi32(m, Kind::kOffsetShift));
          _mm512_store_ps(acc[g][j], _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), d, _mm512_load_ps(acc[g][j])));
        } else {
          _mm512_store_ps(acc[g][j], _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][j]), d, _mm512_load_ps(acc[g][j])));
          _mm512_store_ps(accm[g][j], _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(_mm512_load_ps(t.dmin), da),
                                                      _mm512_load_ps(accm[g][j])));
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __mmask16 valid = static_cast<__mmask16>((1u << rows[g]) - 1);
    for (int j = 0; j < T; ++j) {
      const __m512 result = Kind::kOffsetShift > 0 ? _mm512_load_ps(acc[g][j])
                                                   : _mm512_sub_ps(_mm512_load_ps(acc[g][j]), _mm512_load_ps(accm[g][j]));
      _mm512_mask_storeu_ps(out[j] + 16 * g, valid, result);
    }
  }
}

// Repacked groups per token pass (G of kquant_tile_gemm).
constexpr int kKquantTileGroups = 2;

template <class Ops, KquantTile K, int G>
void kquant_tile_pass(int count, const KquantTileUnit* w, int64_t units, const int8_t* const* aq,
                      const float* const* scale4, const int16_t* const* level_sums, float* const* out,
                      const int* rows, const char* stream, int64_t stream_lines) {
  static_assert(kKquantTileTokens == 4);
  switch (count) {
    case 4: return kquant_tile_gemm<Ops, K, G, 4>(w, units, aq, scale4, level_sums, out, rows, stream, stream_lines);
    case 3: return kquant_tile_gemm<Ops, K, G, 3>(w, units, aq, scale4, level_sums, out, rows, stream, stream_lines);
    case 2: return kquant_tile_gemm<Ops, K, G, 2>(w, units, aq, scale4, level_sums, out, rows, stream, stream_lines);
    default: return kquant_tile_gemm<Ops, K, G, 1>(w, units, aq, scale4, level_sums, out, rows, stream, stream_lines);
  }
}

// The span loop of the repacked tiles (this file's and gguf_block32_tile_avx512.h's), rows
// [n0, n1) of `expert` against pairs [p0, p1): kKquantTileGroups groups of 16 rows at a time
// go to repack(g, row_at) (a group's rows past n1 repeat its last row), then
// pass(groups, count, a, outs, rows, stream, stream_lines) dots them with kTokens pairs at a
// time: a[j] the activation row of pair j, outs[j] its output at the span's first row,
// rows[g] group g's real rows, and `stream_lines` lines of the next span from `stream` to
// prefetch into L2 during the pass (the repack walks 16 rows at once, which the hardware
// prefetchers leave latency-bound).
template <int kTokens, class Matrix, class Repack, class Pass>
void repacked_tile_spans(const Matrix& m, int64_t expert, int64_t n0, int64_t n1, const int32_t* act_rows,
                         int64_t p0, int64_t p1, float* out, int64_t ldo, Repack&& repack, Pass&& pass) {
  constexpr int64_t kSpan = kKquantTileGroups * kKquantTileRows;
  for (int64_t r0 = n0; r0 < n1; r0 += kSpan) {
    const int64_t span = std::min(kSpan, n1 - r0);
    const int groups = static_cast<int>((span + kKquantTileRows - 1) / kKquantTileRows);
    int rows[kKquantTileGroups];
    for (int g = 0; g < groups; ++g) {
      const int64_t first = r0 + g * kKquantTileRows;
      rows[g] = static_cast<int>(std::min<int64_t>(kKquantTileRows, n1 - first));
      const uint8_t* row_at[kKquantTileRows];
      for (int r = 0; r < kKquantTileRows; ++r) row_at[r] = m.row(expert, std::min(first + r, n1 - 1));
      repack(g, row_at);
    }
    const int64_t next_rows = std::min(kSpan, n1 - (r0 + kSpan));
    const char* next = next_rows > 0 ? reinterpret_cast<const char*>(m.row(expert, r0 + kSpan)) : nullptr;
    const int64_t next_lines = next_rows > 0 ? (next_rows * static_cast<int64_t>(m.row_bytes) + 63) / 64 : 0;
    const int64_t passes = (p1 - p0 + kTokens - 1) / kTokens;
    const int64_t lines_per_pass = (next_lines + passes - 1) / passes;
    for (int64_t p = p0, line = 0; p < p1; p += kTokens, line += lines_per_pass) {
      const int64_t stream_lines = std::max<int64_t>(0, std::min(lines_per_pass, next_lines - line));
      const int count = static_cast<int>(std::min<int64_t>(kTokens, p1 - p));
      int64_t a[kTokens];
      float* outs[kTokens];
      for (int j = 0; j < count; ++j) {
        a[j] = act_rows != nullptr ? act_rows[p + j] : p + j;
        outs[j] = out + (p + j) * ldo + r0;
      }
      pass(groups, count, a, outs, rows, next != nullptr ? next + line * 64 : nullptr, stream_lines);
    }
  }
}

// out[p * ldo + n] = dot(row n of `expert`, activation row act_row(p)) for rows [n0, n1)
// and pairs [p0, p1) of a Q4_K, Q5_K (activations in kGgufQ4kActs' format), Q6_K, Q2_K or
// Q3_K matrix (kGgufQ6kActs'): kKquantTileGroups groups of 16 rows repacked at a time, then
// dotted with the pairs kKquantTileTokens at a time.
template <class Ops, KquantTile K, class Matrix>
void kquant_tile_rows(const Matrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
                      const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  const int64_t units = m.kp / kGgufSuper;
  thread_local std::vector<KquantTileUnit> packed;
  packed.resize(static_cast<size_t>(kKquantTileGroups * units));
  const auto repack = [&](int g, const uint8_t* const* row_at) {
    if constexpr (K == KquantTile::kQ6k)
      kquant_tile_repack_q6k(row_at, units, packed.data() + g * units);
    else if constexpr (K == KquantTile::kQ2k || K == KquantTile::kQ3k)
      kquant_tile_repack_q23k<K == KquantTile::kQ3k>(row_at, units, packed.data() + g * units);
    else
      kquant_tile_repack_q4k<K == KquantTile::kQ5k>(row_at, units, packed.data() + g * units);
  };
  const auto pass = [&](int groups, int count, const int64_t* a, float* const* outs, const int* rows,
                        const char* stream, int64_t stream_lines) {
    const int8_t* aq[kKquantTileTokens];
    const float* scale4[kKquantTileTokens];
    const int16_t* level_sums[kKquantTileTokens];
    for (int j = 0; j < count; ++j) {
      aq[j] = acts.q + a[j] * m.kp;
      scale4[j] = acts.scale + a[j] * (m.kp / 4);
      level_sums[j] = acts.level_sums + a[j] * (m.kp / 16);
    }
    static_assert(kKquantTileGroups == 2);
    if (groups == 2)
      kquant_tile_pass<Ops, K, 2>(count, packed.data(), units, aq, scale4, level_sums, outs, rows, stream, stream_lines);
    else
      kquant_tile_pass<Ops, K, 1>(count, packed.data(), units, aq, scale4, level_sums, outs, rows, stream, stream_lines);
  };
  repacked_tile_spans<kKquantTileTokens>(m, expert, n0, n1, act_rows, p0, p1, out, ldo, repack, pass);
}

}  // namespace
}  // namespace kt::cpu
