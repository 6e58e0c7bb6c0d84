#include "dequantize_int.h"

#include <algorithm>
#include <cstring>

#include "../isa/scalar_convert.h"
#include "int_layout.h"
#include "mxfp4_block.h"
#include "transpose_avx2.h"

namespace kt::cpu {
namespace {

using int_layout::kBlockRows;
using int_layout::kLineBytes;

inline float load_float(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Group g's scale of row n: fp32, or mxfp4's bf16 half-scale widened (exact).
inline float group_scale(const uint8_t* block, const int_layout::MatrixDims& dims, int64_t g, int n) {
  const uint8_t* row = block + dims.scales_offset() + g * static_cast<int64_t>(dims.scale_row_bytes);
  if (dims.scale_row_bytes == int_layout::kLineBytes) return load_float(row + 4 * n);
  uint16_t bits;
  std::memcpy(&bits, row + 2 * n, 2);
  return bf16_to_float(bits);
}

// Row n of a block from k = k_begin: line l holds its 4 bytes at 64 l + 4 n (int_layout.h).
// Written to out.at(i, k).
void int8_row(const uint8_t* block, const int_layout::MatrixDims& dims, int n, const RowsOut& out, int64_t i,
              int64_t k_begin) {
  const float scale = load_float(block + dims.scales_offset() + 4 * n);
  const uint8_t* bytes = block + 4 * n;
  for (int64_t k = k_begin; k < dims.k; ++k) {
    const uint8_t* line = bytes + (k / 4) * kLineBytes;
    *out.at(i, k) = static_cast<float>(line[k % 4] - int_layout::kInt8Zero) * scale;
  }
}

// Line l holds k = 8l + i (low nibbles of row n's 4 bytes) and 8l + 4 + i (high nibbles).
// k_begin: a multiple of 8. int4: (q - 8) * scale; int4_asym: q * scale + minimum;
// mxfp4: kValues[q] * half_scale (one exact product).
template <PackedFormat kFormat>
void int4_row(const uint8_t* block, const int_layout::MatrixDims& dims, int n, const RowsOut& out, int64_t row,
              int64_t k_begin) {
  const uint8_t* bytes = block + 4 * n;
  for (int64_t g = k_begin / dims.group; g < dims.groups; ++g) {
    constexpr bool kMinimums = kFormat == PackedFormat::kInt4Asym;
    const float scale = group_scale(block, dims, g, n);
    const float minimum = kMinimums ? load_float(block + dims.minimums_offset() + (g * kBlockRows + n) * 4) : 0.0f;
    for (int64_t k = std::max(g * dims.group, k_begin); k < (g + 1) * dims.group; k += 8) {
      uint32_t word;  // byte i: k + i (low nibble), k + 4 + i (high nibble)
      std::memcpy(&word, bytes + (k / 8) * kLineBytes, 4);
      float* target = out.at(row, k);  // k + i, i < 8: within one panel
      for (int i = 0; i < 8; ++i) {
        const int q = static_cast<int>((word >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15);
        if (kMinimums) {
          const float product = static_cast<float>(q) * scale;
          target[i] = product + minimum;
        } else if (kFormat == PackedFormat::kMxfp4) {
          target[i] = static_cast<float>(mxfp4::kValues[q]) * scale;
        } else {
          target[i] = static_cast<float>(q - int_layout::kInt4Zero) * scale;
        }
      }
    }
  }
}

// The AVX2 paths: rows n0..n0+7 of a block, lines [l0, l0 + 8), the same operations as the
// scalar rows above (a product, then a sum where they have one: no FMA), so the same bits.
// Byte j (j < 8) of `v` (as 128 bits, from byte 8 * half) widened to 8 int32.
__attribute__((target("avx2"))) inline __m256i bytes_to_int32(__m128i v, int half) {
  return _mm256_cvtepu8_epi32(half ? _mm_srli_si128(v, 8) : v);
}

// Lines [l, l + 8) of a block towards L1: the 8 x 8 paths below ask for the lines two
// calls ahead of the ones they load (weights stream from memory once per decode; the
// training backward's AMXINT8 pass measured 390 -> 340 ms with it on Zen 3, S1, 512 tokens).
// A prefetch past the block's end is harmless.
inline void prefetch_lines(const uint8_t* block, int64_t l) {
  for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(block + (l + i) * kLineBytes), _MM_HINT_T0);
}

// Rows n0..n0+7 go to out.at(row0 + i, k). A byte b stores q + 128, and b ^ 0x80 read as
// int8 is q: one xor per 32 bytes and sign-extending widenings, where a zero-extending
// widening needed a subtraction per 8 (the same q, so the same bits).
__attribute__((target("avx2"))) void int8_8x8_avx2(const uint8_t* block, const int_layout::MatrixDims& dims, int n0,
                                                   int64_t l0, const RowsOut out, int64_t row0) {
  static_assert(int_layout::kInt8Zero == 128, "the xor below maps b to b - 128");
  __m256i t[8];  // t[i]: row n0 + i's bytes of k = 4 l0 .. 4 l0 + 31
  prefetch_lines(block, l0 + 16);
  load_transposed_8x8(block + l0 * kLineBytes + 4 * n0, kLineBytes, t);
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int i = 0; i < 8; ++i) {
    const __m256 scale = _mm256_set1_ps(load_float(block + dims.scales_offset() + 4 * (n0 + i)));
    const __m256i q = _mm256_xor_si256(t[i], sign);
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int j = 0; j < 4; ++j) {
      const __m128i bytes = j % 2 ? _mm_srli_si128(halves[j / 2], 8) : halves[j / 2];
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      _mm256_storeu_ps(out.at(row0 + i, 4 * l0 + 8 * j), _mm256_mul_ps(v, scale));
    }
  }
}

template <PackedFormat kFormat>
__attribute__((target("avx2"))) void int4_8x8_avx2(const uint8_t* block, const int_layout::MatrixDims& dims, int n0,
                                                   int64_t l0, const RowsOut out, int64_t row0) {
  __m256i t[8];  // t[i] lane j: row n0 + i's word of line l0 + j (k = 8 (l0 + j) .. + 7)
  prefetch_lines(block, l0 + 16);
  load_transposed_8x8(block + l0 * kLineBytes + 4 * n0, kLineBytes, t);
  constexpr bool kMinimums = kFormat == PackedFormat::kInt4Asym, kMx = kFormat == PackedFormat::kMxfp4;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i zero = _mm256_set1_epi32(kMx ? int_layout::kMxfp4LevelBias : int_layout::kInt4Zero);
  // mxfp4: codes -> kValues + 16 (int_layout.h), so the unsigned widening below applies
  const __m256i levels = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mxfp4::kLevels.bytes));
  for (int i = 0; i < 8; ++i) {
    __m256i low = _mm256_and_si256(t[i], nibble), high = _mm256_and_si256(_mm256_srli_epi16(t[i], 4), nibble);
    if (kMx) {
      low = _mm256_shuffle_epi8(levels, low);
      high = _mm256_shuffle_epi8(levels, high);
    }
    // Per word: its 4 low nibbles (k + 0..3), then its 4 high nibbles (k + 4..7).
    const __m256i a = _mm256_unpacklo_epi32(low, high), b = _mm256_unpackhi_epi32(low, high);
    const __m256i ordered[2] = {_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)};
    for (int q = 0; q < 8; ++q) {  // k = 8 (l0 + q) .. + 7: one group
      const int64_t k = 8 * (l0 + q), g = k / dims.group;
      const __m128i half = q % 4 < 2 ? _mm256_castsi256_si128(ordered[q / 4]) : _mm256_extracti128_si256(ordered[q / 4], 1);
      const __m256i v = bytes_to_int32(half, q % 2);
      const __m256 scale = _mm256_set1_ps(group_scale(block, dims, g, n0 + i));
      if (kMinimums) {
        const __m256 minimum =
            _mm256_set1_ps(load_float(block + dims.minimums_offset() + (g * kBlockRows + n0 + i) * 4));
        _mm256_storeu_ps(out.at(row0 + i, k), _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), scale), minimum));
      } else {
        _mm256_storeu_ps(out.at(row0 + i, k), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, zero)), scale));
      }
    }
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

}  // namespace

void dequantize_int_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                            int64_t row_begin, int64_t row_end, const RowsOut& out) {
  const int_layout::Dims dims(layout.shape);
  const bool down = matrix == ExpertMatrix::kDown;
  const int_layout::MatrixDims& m = down ? dims.down : dims.gate_up;
  const PackedFormat format = layout.shape.format;
  // Lines whose k all lie within the row (int8: 4 per line, int4: 8).
  const int64_t k_per_line = format == PackedFormat::kInt8 ? 4 : 8, full_lines = m.k / k_per_line;
  for (int64_t r = row_begin; r < row_end;) {
    const uint8_t* b = row_block(blob, layout, matrix, expert, r, m.block_bytes());
    const int n = static_cast<int>(r % kBlockRows);
    const int64_t row0 = r - row_begin;  // where row r goes in `out`
    int64_t k_begin = 0;  // where the scalar rows start
    int rows = 1;
    if (kHasAvx2 && n % 8 == 0 && r + 8 <= row_end && full_lines >= 8) {  // 8 rows x 8 lines at a time
      rows = 8;
      int64_t l0 = 0;
      for (; l0 + 8 <= full_lines; l0 += 8) {
        if (format == PackedFormat::kInt8) int8_8x8_avx2(b, m, n, l0, out, row0);
        else if (format == PackedFormat::kInt4) int4_8x8_avx2<PackedFormat::kInt4>(b, m, n, l0, out, row0);
        else if (format == PackedFormat::kMxfp4) int4_8x8_avx2<PackedFormat::kMxfp4>(b, m, n, l0, out, row0);
        else int4_8x8_avx2<PackedFormat::kInt4Asym>(b, m, n, l0, out, row0);
      }
      k_begin = l0 * k_per_line;
    }
    for (int i = 0; i < rows; ++i) {
      if (format == PackedFormat::kInt8) int8_row(b, m, n + i, out, row0 + i, k_begin);
      else if (format == PackedFormat::kInt4) int4_row<PackedFormat::kInt4>(b, m, n + i, out, row0 + i, k_begin);
      else if (format == PackedFormat::kMxfp4) int4_row<PackedFormat::kMxfp4>(b, m, n + i, out, row0 + i, k_begin);
      else int4_row<PackedFormat::kInt4Asym>(b, m, n + i, out, row0 + i, k_begin);
    }
    r += rows;
  }
}

void dequantize_int_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out) {
  dequantize_row_major(dequantize_int_rows_to, blob, layout, matrix, expert, row_begin, row_end, out);
}

}  // namespace kt::cpu
