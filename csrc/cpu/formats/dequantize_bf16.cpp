#include "dequantize_bf16.h"

#include <algorithm>
#include <cstring>

#include "bf16_layout.h"
#include "transpose_avx2.h"

namespace kt::cpu {
namespace {

// 8 rows x 16 consecutive values (8 k-pairs) of a block: lines[p * kLineBytes + 4 * i]
// holds row i's pair p. Each pair widens to two fp32 values (bf16 -> fp32 is a 16-bit
// shift: exact, as the scalar loop).
// Row i's 16 values go to out.at(row0 + i, k0) .. + 15 (k0 a multiple of 16: one panel).
__attribute__((target("avx2"))) void widen_8x8_pairs_avx2(const uint8_t* lines, const RowsOut out, int64_t row0,
                                                          int64_t k0) {
  __m256i t[8];
  load_transposed_8x8(lines, bf16_layout::kLineBytes, t);  // t[i] lane p = row i's pair p
  const __m256i high_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int i = 0; i < 8; ++i) {
    const __m256i even = _mm256_slli_epi32(t[i], 16), odd = _mm256_and_si256(t[i], high_mask);
    const __m256i a = _mm256_unpacklo_epi32(even, odd), b = _mm256_unpackhi_epi32(even, odd);
    float* row = out.at(row0 + i, k0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 8), _mm256_permute2x128_si256(a, b, 0x31));
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

}  // namespace

void dequantize_bf16_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                             int64_t row_begin, int64_t row_end, const RowsOut& out) {
  using bf16_layout::kBlockRows;
  using bf16_layout::kLineBytes;
  const bf16_layout::Dims dims(layout.shape.hidden_size, layout.shape.intermediate_size);
  const bool down = matrix == ExpertMatrix::kDown;
  const size_t block_bytes = down ? dims.down_block_bytes() : dims.gate_up_block_bytes();
  const int64_t K = down ? dims.intermediate : dims.hidden;
  // Block by block, 32 lines (2 KiB, 64 values of each of the block's 16 rows) at a time:
  // line p holds k = 2p, 2p + 1 of the 16 rows (row n's pair is 4 bytes at 4n). The chunk
  // stays in L1 while each row's 64 values are written in order (2026-11-26, Zen 3: one
  // row at a time over all lines took ~200 ms of a 512-token S1 backward; all 16 rows per
  // line, 16 write streams 8 KiB apart, took 350-640 ms).
  constexpr int64_t kChunkPairs = 32;
  const int64_t pairs = K / 2;
  for (int64_t r0 = row_begin; r0 < row_end;) {
    const int64_t r1 = std::min(row_end, (r0 / kBlockRows + 1) * kBlockRows);
    const uint8_t* block = row_block(blob, layout, matrix, expert, r0, block_bytes) + 4 * (r0 % kBlockRows);
    const int64_t first = r0 - row_begin;  // where row r0 goes in `out`
    for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
      const int64_t p1 = std::min(pairs, p0 + kChunkPairs);
      int64_t i = 0;
      if (kHasAvx2 && p1 - p0 == kChunkPairs) {  // 8 rows x 8 pairs at a time
        for (; i + 8 <= r1 - r0; i += 8)
          for (int64_t p = p0; p < p1; p += 8) widen_8x8_pairs_avx2(block + p * kLineBytes + 4 * i, out, first + i, 2 * p);
      }
      for (; i < r1 - r0; ++i) {
        const uint8_t* line = block + p0 * kLineBytes + 4 * i;
        for (int64_t p = p0; p < p1; ++p, line += kLineBytes) {
          uint32_t pair;
          std::memcpy(&pair, line, 4);
          const uint32_t low = pair << 16, high = pair & 0xffff0000u;
          std::memcpy(out.at(first + i, 2 * p), &low, 4);
          std::memcpy(out.at(first + i, 2 * p + 1), &high, 4);
        }
      }
    }
    if (K % 2 != 0) {  // odd K: the last pair's first value
      for (int64_t i = 0; i < r1 - r0; ++i) {
        uint32_t pair;
        std::memcpy(&pair, block + pairs * kLineBytes + 4 * i, 4);
        const uint32_t low = pair << 16;
        std::memcpy(out.at(first + i, K - 1), &low, 4);
      }
    }
    r0 = r1;
  }
}

void dequantize_bf16_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                          int64_t row_begin, int64_t row_end, float* out) {
  dequantize_row_major(dequantize_bf16_rows_to, blob, layout, matrix, expert, row_begin, row_end, out);
}

}  // namespace kt::cpu
