// [NOTE] GGUF block decoders: each quantized type's blocks -> one common form per 256
// weights, so a single dot-product micro-kernel (gguf_dot.h) serves every type:
//   w[e] = scale[e / 4] * q[e] - minimum[e / 16]       (q unsigned bytes)
// Sub-block scales become per-lane (4 weights) floats, zero points and signed offsets
// (Q4_0's -8, Q6_K's -32, Q3_K's -4, Q8_0's offset binary) become per-16 minimums that
// the kernel removes with the activation sums. Q8_0 keeps its levels as offset binary
// (q + 128): the vpdpbusd kernels cancel the offset in integers (gguf_act.h's bias4),
// the vpmaddubsw paths multiply signed levels directly; either way no minimum. MXFP4's
// doubled e2m1 values v (|v| <= 12) become levels v + 16 with minimum 16 * d per 16, as
// Q5_0's q - 16 (its half scale d per block).
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K and Q6_K have AVX2 decoders (every
// variant has AVX2 + F16C); the others are plain loops over fixed-size arrays that each
// variant's compiler vectorizes. Include only from a variant translation unit, after
// its target pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../formats/gguf_types.h"
#include "../../formats/mxfp4_block.h"
#include "../../isa/scalar_convert.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kGgufSuper = 256;  // weights per decoded unit
// The in-place decode kernels (gguf_q4k_avx512.h, gguf_block32_avx512.h) prefetch each row's
// bytes this far ahead, and gguf_direct_rows requests the first bytes of all four row
// streams at once: the hardware prefetchers alone left the streams latency-bound
// (1-token S1 Q4_K 1270-1320 -> 1090-1100 us, S2 2070 -> 1500-1540 us; 2 KiB ahead
// measured no better than 1 KiB).
constexpr int kGgufPrefetchBytes = 1024;

// A unit's `bytes` at b, requested kGgufPrefetchBytes ahead (to L1, line by line): the
// in-place K-quant kernels' prefetch of each row's next bytes.
inline void gguf_prefetch_ahead(const uint8_t* b, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(b + kGgufPrefetchBytes + line), _MM_HINT_T0);
}

// What an AVX2 in-place pass over four rows does with their levels: extract them from
// the GGUF bytes (kExtract), extract and keep them for the next passes over the same rows
// (kKeep), or take the kept ones (kLoad). Either way each (row, activation row) result
// takes the same operations on the same values (gguf_rows.h's gguf_keeps_levels).
enum class KeptLevels { kExtract, kKeep, kLoad };

struct alignas(64) GgufDecoded {
  uint8_t q[kGgufSuper];
  float scale[kGgufSuper / 4];
  float minimum[kGgufSuper / 16];
};

inline float gguf_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store256(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// scale[8j, 8j + 8) = s[j] (sub-blocks of 32) for the 8 values of s.
inline void spread8x8(__m256 s, float* scale) {
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(scale + 8 * j, _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(j)));
}
// minimum[2j] = minimum[2j + 1] = m[j] for the 8 values of m.
inline void spread8x2(__m256 m, float* minimum) {
  _mm256_storeu_ps(minimum, _mm256_permutevar8x32_ps(m, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
  _mm256_storeu_ps(minimum + 8, _mm256_permutevar8x32_ps(m, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
}
// scale[4j, 4j + 4) = s[j] for 16 sub-blocks of 16 (s_lo: 0-7, s_hi: 8-15).
inline void spread16x4(__m256 s_lo, __m256 s_hi, float* scale) {
  for (int j = 0; j < 8; j += 2) {
    const __m256i idx = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
    _mm256_storeu_ps(scale + 4 * j, _mm256_permutevar8x32_ps(s_lo, idx));
    _mm256_storeu_ps(scale + 32 + 4 * j, _mm256_permutevar8x32_ps(s_hi, idx));
  }
}

// 32-weight block types: `blocks` (1..8) blocks into one unit; the rest of the unit
// must be zero already (gguf_decode_row_of clears a row's partial last unit).
void decode_q8_0(const uint8_t* b, int blocks, GgufDecoded& out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) float d[8] = {};
  for (int k = 0; k < blocks; ++k, b += 34) {
    d[k] = gguf_f16(b);
    store256(out.q + 32 * k, _mm256_xor_si256(load256(b + 2), flip));
  }
  spread8x8(_mm256_load_ps(d), out.scale);
  std::memset(out.minimum, 0, sizeof(out.minimum));
}

// 32 bits -> 32 bytes, 0xff where the bit is set (bit j -> byte j).
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1));
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 8 full blocks (nibbles: low = weight j, high = j + 16;
// Q5: bit j of a 32-bit word is bit 4 of weight j).
template <bool kFiveBit, bool kHasMin>
void decode_q45_01(const uint8_t* b, int blocks, GgufDecoded& out) {
  constexpr int kBytes = 18 + (kHasMin ? 2 : 0) + (kFiveBit ? 4 : 0);
  constexpr int kQs = 2 + (kHasMin ? 2 : 0) + (kFiveBit ? 4 : 0);
  const __m128i low = _mm_set1_epi8(0x0f);
  alignas(32) float d[8] = {}, m[8] = {};
  for (int k = 0; k < blocks; ++k, b += kBytes) {
    d[k] = gguf_f16(b);
    m[k] = kHasMin ? -gguf_f16(b + 2) : (kFiveBit ? 16.0f : 8.0f) * d[k];
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQs));
    __m256i q = _mm256_setr_m128i(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
    if (kFiveBit) {
      uint32_t high;
      std::memcpy(&high, b + kQs - 4, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(high), _mm256_set1_epi8(0x10)));
    }
    store256(out.q + 32 * k, q);
  }
  spread8x8(_mm256_load_ps(d), out.scale);
  spread8x2(_mm256_load_ps(m), out.minimum);
}

// MXFP4's half scales 2^(e - 128) of 4 blocks `stride` bytes apart (exponent byte
// first) from their bits (mxfp4::half_scale_bits: e < 2 subnormal, 255 NaN).
inline __m128 mxfp4_half_scales4(const uint8_t* b, int stride) {
  const uint32_t e0 = b[0], e1 = b[stride], e2 = b[2 * stride], e3 = b[3 * stride];
  const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(e0 | e1 << 8 | e2 << 16 | e3 << 24)));
  __m128i bits = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);  // e in [2, 254]: a normal float
  // Exponents 0, 1 (subnormal scales) and 255 (NaN) are rare: one well-predicted branch
  // keeps their blends off the common path.
  if (__builtin_expect((e0 - 2u > 252u) | (e1 - 2u > 252u) | (e2 - 2u > 252u) | (e3 - 2u > 252u), 0)) {
    bits = _mm_blendv_epi8(bits, _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e),
                           _mm_cmplt_epi32(e, _mm_set1_epi32(2)));
    bits = _mm_blendv_epi8(bits, _mm_set1_epi32(0x7fc00000),
                           _mm_cmpeq_epi32(e, _mm_set1_epi32(mxfp4::kNanExponent)));
  }
  return _mm_castsi128_ps(bits);
}

// The levels v + 16 of MXFP4's codes, for a vpshufb on the nibbles (either 128-bit lane).
inline __m128i mxfp4_level_table() {
  static_assert(mxfp4::kValues[7] == 12 && mxfp4::kValues[15] == -12);
  return _mm_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4);
}

// MXFP4: `blocks` (1..8) blocks of 17 bytes.
void decode_mxfp4(const uint8_t* b, int blocks, GgufDecoded& out) {
  const __m128i low = _mm_set1_epi8(0x0f), table = mxfp4_level_table();
  alignas(32) float d[8] = {}, m[8] = {};
  for (int k = 0; k < blocks; ++k, b += mxfp4::kBlockBytes) {
    d[k] = mxfp4::half_scale(b[0]);
    m[k] = 16.0f * d[k];
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
    store256(out.q + 32 * k, _mm256_setr_m128i(_mm_shuffle_epi8(table, _mm_and_si128(v, low)),
                                               _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low))));
  }
  spread8x8(_mm256_load_ps(d), out.scale);
  spread8x2(_mm256_load_ps(m), out.minimum);
}

void decode_q4_k(const uint8_t* b, GgufDecoded& out) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load256(b + 16 + 32 * c);
    store256(out.q + 64 * c, _mm256_and_si256(v, low));
    store256(out.q + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
  }
  // 8 6-bit scales and 8 6-bit minimums from 12 bytes (as ggml's AVX2 kernels do).
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  const uint32_t mins_low = u[1] & k6;
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  u[2] = mins_low;
  u[0] &= k6;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));  // sc[0..7], m[0..7]
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  spread8x8(_mm256_mul_ps(sc, _mm256_set1_ps(gguf_f16(b))), out.scale);
  spread8x2(_mm256_mul_ps(m, _mm256_set1_ps(gguf_f16(b + 2))), out.minimum);
}

void decode_q6_k(const uint8_t* b, GgufDecoded& out) {
  const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n) {
    const __m256i l0 = load256(b + 64 * n), l1 = load256(b + 64 * n + 32), h = load256(b + 128 + 32 * n);
    auto high = [&](int shift) {
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), two), 4);
    };
    uint8_t* q = out.q + 128 * n;
    store256(q, _mm256_or_si256(_mm256_and_si256(l0, low), high(0)));
    store256(q + 32, _mm256_or_si256(_mm256_and_si256(l1, low), high(2)));
    store256(q + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), high(4)));
    store256(q + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), high(6)));
  }
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256 d = _mm256_set1_ps(gguf_f16(b + 208));
  const __m256 s_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
  const __m256 s_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
  spread16x4(s_lo, s_hi, out.scale);
  const __m256 k32 = _mm256_set1_ps(32.0f);
  _mm256_storeu_ps(out.minimum, _mm256_mul_ps(s_lo, k32));
  _mm256_storeu_ps(out.minimum + 8, _mm256_mul_ps(s_hi, k32));
}

// Per-lane scales of sub-blocks of `size` weights: scale[e / 4] = values[e / size].
template <int kSize>
void spread_scales(const float* values, int subblocks, float* scale, float* minimum, const float* mins) {
  for (int j = 0; j < subblocks; ++j) {
    for (int i = 0; i < kSize / 4; ++i) scale[j * (kSize / 4) + i] = values[j];
    for (int i = 0; i < kSize / 16; ++i) minimum[j * (kSize / 16) + i] = mins[j];
  }
}

// --- 256-weight super-blocks (one per unit) ---

void decode_q2_k(const uint8_t* b, GgufDecoded& out) {
  const float d = gguf_f16(b + 80), dmin = gguf_f16(b + 82);
  float sc[16], m[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = d * static_cast<float>(b[j] & 15);
    m[j] = dmin * static_cast<float>(b[j] >> 4);
  }
  const uint8_t* qs = b + 16;
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) out.q[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
  spread_scales<16>(sc, 16, out.scale, out.minimum, m);
}

void decode_q3_k(const uint8_t* b, GgufDecoded& out) {
  const float d = gguf_f16(b + 108);
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* s = b + 96;
  float sc[16], m[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = d * static_cast<float>((low | (high << 4)) - 32);
    m[i] = 4.0f * sc[i];
  }
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l)
        out.q[128 * n + 32 * j + l] = static_cast<uint8_t>(((qs[32 * n + l] >> (2 * j)) & 3) |
                                                           (((hmask[l] >> (4 * n + j)) & 1) << 2));
  spread_scales<16>(sc, 16, out.scale, out.minimum, m);
}

// Q4_K / Q5_K 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_q5_k(const uint8_t* b, GgufDecoded& out) {
  const float d = gguf_f16(b), dmin = gguf_f16(b + 2);
  float sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    int s, mm;
    scale_min_k4(j, b + 4, s, mm);
    sc[j] = d * static_cast<float>(s);
    m[j] = dmin * static_cast<float>(mm);
  }
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      out.q[64 * c + l] = static_cast<uint8_t>((qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4));
      out.q[64 * c + 32 + l] = static_cast<uint8_t>((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
    }
  spread_scales<32>(sc, 8, out.scale, out.minimum, m);
}

template <GgmlType kType>
void decode_unit(const uint8_t* src, int blocks, GgufDecoded& o) {
  if constexpr (kType == GgmlType::kQ8_0) decode_q8_0(src, blocks, o);
  else if constexpr (kType == GgmlType::kQ4_0) decode_q45_01<false, false>(src, blocks, o);
  else if constexpr (kType == GgmlType::kQ4_1) decode_q45_01<false, true>(src, blocks, o);
  else if constexpr (kType == GgmlType::kQ5_0) decode_q45_01<true, false>(src, blocks, o);
  else if constexpr (kType == GgmlType::kQ5_1) decode_q45_01<true, true>(src, blocks, o);
  else if constexpr (kType == GgmlType::kMxfp4) decode_mxfp4(src, blocks, o);
  else if constexpr (kType == GgmlType::kQ2_K) decode_q2_k(src, o);
  else if constexpr (kType == GgmlType::kQ3_K) decode_q3_k(src, o);
  else if constexpr (kType == GgmlType::kQ4_K) decode_q4_k(src, o);
  else if constexpr (kType == GgmlType::kQ5_K) decode_q5_k(src, o);
  else decode_q6_k(src, o);
}

// Decodes a row of k weights of kType into ceil(k / 256) units; the part of the last
// unit past k is zero (zero levels, scales and minimums).
template <GgmlType kType, uint32_t kBlockElems, uint32_t kBlockBytes>
void gguf_decode_row_of(const uint8_t* row, int64_t k, GgufDecoded* out) {
  constexpr int64_t kUnitBytes = kGgufSuper / kBlockElems * kBlockBytes;
  const int64_t full = k / kGgufSuper;
  for (int64_t u = 0; u < full; ++u) decode_unit<kType>(row + u * kUnitBytes, 8, out[u]);
  if (full * kGgufSuper < k) {  // 32-weight types only (K-quant rows are multiples of 256)
    std::memset(&out[full], 0, sizeof(GgufDecoded));
    decode_unit<kType>(row + full * kUnitBytes, static_cast<int>((k - full * kGgufSuper) / 32), out[full]);
  }
}

using GgufDecodeRowFn = void (*)(const uint8_t* row, int64_t k, GgufDecoded* out);

// The row decoder of a quantized type (nullptr for float types).
GgufDecodeRowFn gguf_decoder(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0: return gguf_decode_row_of<GgmlType::kQ8_0, 32, 34>;
    case GgmlType::kQ4_0: return gguf_decode_row_of<GgmlType::kQ4_0, 32, 18>;
    case GgmlType::kQ4_1: return gguf_decode_row_of<GgmlType::kQ4_1, 32, 20>;
    case GgmlType::kQ5_0: return gguf_decode_row_of<GgmlType::kQ5_0, 32, 22>;
    case GgmlType::kQ5_1: return gguf_decode_row_of<GgmlType::kQ5_1, 32, 24>;
    case GgmlType::kMxfp4: return gguf_decode_row_of<GgmlType::kMxfp4, 32, mxfp4::kBlockBytes>;
    case GgmlType::kQ2_K: return gguf_decode_row_of<GgmlType::kQ2_K, 256, 84>;
    case GgmlType::kQ3_K: return gguf_decode_row_of<GgmlType::kQ3_K, 256, 110>;
    case GgmlType::kQ4_K: return gguf_decode_row_of<GgmlType::kQ4_K, 256, 144>;
    case GgmlType::kQ5_K: return gguf_decode_row_of<GgmlType::kQ5_K, 256, 176>;
    case GgmlType::kQ6_K: return gguf_decode_row_of<GgmlType::kQ6_K, 256, 210>;
    default: return nullptr;
  }
}

}  // namespace
}  // namespace kt::cpu
