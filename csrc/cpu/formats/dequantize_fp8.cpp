#include "dequantize_fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "fp8_layout.h"
#include "transpose_avx2.h"

namespace kt::cpu {
namespace {

using fp8_layout::kBlockRows;

// e4m3 (float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN) of every code, exact.
std::array<float, 256> e4m3_values() {
  std::array<float, 256> values{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    float v = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                            : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
    if ((code & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
    values[code] = code & 0x80 ? -v : v;
  }
  return values;
}

const std::array<float, 256> kE4m3 = e4m3_values();

// 2^(e - 127), e = 255 NaN (OCP MX E8M0).
float ue8m0(uint8_t e) {
  if (e == fp8_layout::kMxNan) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Row n of a block from k = k_begin (a multiple of 16 or 0), to out.at(i, k).
void fp8_row(const uint8_t* b, const fp8_layout::MatrixDims& m, int n, int64_t k_begin, const RowsOut& out,
             int64_t i) {
  float addend = 0.0f;
  if (m.byte_scales) std::memcpy(&addend, b + m.addend_offset() + 4 * n, 4);
  // k-pair p of row n: 2 codes at 32 p + 2 n.
  const uint8_t* codes = b + 2 * n;
  for (int64_t g = k_begin / m.group; g < m.groups; ++g) {
    float scale;
    if (m.byte_scales) scale = ue8m0(b[m.scales_offset() + g * kBlockRows + n]);
    else std::memcpy(&scale, b + m.scales_offset() + (g * kBlockRows + n) * 4, 4);
    const int64_t end = std::min<int64_t>((g + 1) * m.group, m.k);
    for (int64_t k = std::max(g * m.group, k_begin); k < end; ++k) {
      const float product = kE4m3[codes[(k / 2) * 32 + (k & 1)]] * scale;
      *out.at(i, k) = product + addend;
    }
  }
}

// The AVX2 path: e4m3 codes (int32 lanes) -> fp32, the table's values bit for bit (NaN
// codes quiet NaN, the sign applied after, as the table negates).
__attribute__((target("avx2"))) inline __m256 e4m3_avx2(__m256i c) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(15));
  const __m256i m = _mm256_and_si256(c, _mm256_set1_epi32(7));
  const __m256i normal = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
                                         _mm256_slli_epi32(m, 20));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.0f / 512));
  __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), subnormal,
                              _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
  const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), _mm256_set1_epi32(0x7f));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), _mm256_castsi256_ps(nan));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// The 16 rows of a block, k = 2 p0 .. 2 p0 + 15 (8 k-pairs, one scale group): a line's
// 32 bytes are 8 words of two rows' pairs, so the 8 x 8 word transpose gives rows 2j and
// 2j + 1 their 16 codes each. out.at(row0 + n, k) = e4m3 * scale[n] + addend[n], as the
// rows above (a product, then a sum: no FMA).
__attribute__((target("avx2"))) void fp8_block_16x16_avx2(const uint8_t* codes, int64_t p0, const float* scale,
                                                          const float* addend, const RowsOut out, int64_t row0) {
  __m256i t[8];  // t[j] lane l: row 2j's codes of k = 2(p0 + l), + 1, then row 2j + 1's
  load_transposed_8x8(codes + p0 * 32, 32, t);
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int j = 0; j < 8; ++j) {
    const __m256i rows = _mm256_shuffle_epi8(t[j], split);  // per 128 bits: row 2j's 8 codes, row 2j + 1's
    const __m128i halves[2] = {_mm256_castsi256_si128(rows), _mm256_extracti128_si256(rows, 1)};
    for (int r = 0; r < 2; ++r) {
      const int n = 2 * j + r;
      const __m256 sc = _mm256_set1_ps(scale[n]), add = _mm256_set1_ps(addend[n]);
      float* row = out.at(row0 + n, 2 * p0);  // 16 k from a multiple of 16: one panel
      for (int h = 0; h < 2; ++h) {  // k + 0..7 (lines 0-3), k + 8..15 (lines 4-7)
        const __m128i c8 = r ? _mm_srli_si128(halves[h], 8) : halves[h];
        const __m256 w = e4m3_avx2(_mm256_cvtepu8_epi32(c8));
        _mm256_storeu_ps(row + 8 * h, _mm256_add_ps(_mm256_mul_ps(w, sc), add));
      }
    }
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

}  // namespace

void dequantize_fp8_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                            int64_t row_begin, int64_t row_end, const RowsOut& out) {
  const fp8_layout::Dims dims(layout.shape);
  const bool down = matrix == ExpertMatrix::kDown;
  const fp8_layout::MatrixDims& m = down ? dims.down : dims.gate_up;
  const int64_t first = row_begin;  // out's row 0
  if (kHasAvx2 && m.group % 16 == 0) {  // whole blocks: 16 rows x 16 k at a time, then the rows' tails
    const int64_t pairs = m.k / 16 * 8;  // k-pairs in whole 16-k steps
    for (; row_begin % kBlockRows == 0 && row_begin + kBlockRows <= row_end; row_begin += kBlockRows) {
      const uint8_t* b = row_block(blob, layout, matrix, expert, row_begin, m.block_bytes());
      float addend[kBlockRows] = {};
      if (m.byte_scales) std::memcpy(addend, b + m.addend_offset(), sizeof(addend));
      for (int64_t p0 = 0; p0 < pairs; p0 += 8) {
        const int64_t g = 2 * p0 / m.group;
        float scale[kBlockRows];
        for (int n = 0; n < kBlockRows; ++n) {
          if (m.byte_scales) scale[n] = ue8m0(b[m.scales_offset() + g * kBlockRows + n]);
          else std::memcpy(&scale[n], b + m.scales_offset() + (g * kBlockRows + n) * 4, 4);
        }
        fp8_block_16x16_avx2(b, p0, scale, addend, out, row_begin - first);
      }
      for (int n = 0; n < kBlockRows; ++n) fp8_row(b, m, n, 2 * pairs, out, row_begin - first + n);
    }
  }
  for (int64_t r = row_begin; r < row_end; ++r)
    fp8_row(row_block(blob, layout, matrix, expert, r, m.block_bytes()), m, static_cast<int>(r % kBlockRows), 0, out,
            r - first);
}

void dequantize_fp8_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out) {
  dequantize_row_major(dequantize_fp8_rows_to, blob, layout, matrix, expert, row_begin, row_end, out);
}

}  // namespace kt::cpu
