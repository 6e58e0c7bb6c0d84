#include "expert_staging.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "bf16_layout.h"
#include "fp8_layout.h"
#include "gguf_types.h"
#include "int_layout.h"
#include "mxfp4_block.h"
#include "packed_header.h"
#include "transpose_avx2.h"

namespace kt::cpu {
namespace {

constexpr int kRows = 16;  // rows per block of the tiled formats

// The rows of one 16-row block of a matrix: gate_up blocks alternate gate (even) and up
// (odd) over intermediate rows; down blocks are hidden rows.
struct BlockRows {
  uint8_t* codes;   // destination of the block's first row
  uint8_t* scales;  // same for the scales (nullptr: none)
  int64_t rows;     // real rows in the block (the last block may be partial; 0: padding only)
};

BlockRows block_rows(const StagingRows& out, bool gate_up, int64_t block, int64_t real_rows, size_t row_bytes,
                     size_t scale_row_bytes) {
  const int64_t first = (gate_up ? block / 2 : block) * kRows;
  const int64_t rows = std::clamp<int64_t>(real_rows - first, 0, kRows);
  uint8_t* codes = gate_up ? (block % 2 == 0 ? out.gate : out.up) : out.down;
  uint8_t* scales = gate_up ? (block % 2 == 0 ? out.gate_scale : out.up_scale) : out.down_scale;
  return {codes + first * row_bytes, scales == nullptr ? nullptr : scales + first * scale_row_bytes, rows};
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

// What untile_words_avx2 does to each row's word of a line before storing it.
enum class Word { kAsIs, kNibbles, kOffsetBytes };

// One row's word of a line as untile_words_avx2 stores it.
template <Word kWord>
__attribute__((target("avx2"))) inline __m256i convert_words(__m256i w) {
  if (kWord == Word::kOffsetBytes) w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  if (kWord == Word::kNibbles) {  // 16-bit lane (s0, s1) -> bytes (lo s0 | lo s1 << 4, hi s0 | hi s1 << 4)
    const __m256i low = _mm256_set1_epi16(0x000f), high = _mm256_set1_epi16(0x00f0);
    // a dword's bytes (out0, out2, out1, out3) -> (out0, out1, out2, out3)
    const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                           0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    const __m256i a = _mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(_mm256_srli_epi16(w, 4), high));
    const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                                      _mm256_and_si256(_mm256_srli_epi16(w, 8), high));
    w = _mm256_shuffle_epi8(_mm256_or_si256(a, _mm256_slli_epi16(b, 8)), order);
  }
  return w;
}

// 64 bytes of a row (halves a, b) at `to`: streamed where they are one aligned cache line,
// stored plainly otherwise (the callers' fence orders the streamed ones).
__attribute__((target("avx2"))) inline void store_line(uint8_t* to, __m256i a, __m256i b) {
  __m256i* line = reinterpret_cast<__m256i*>(to);
  if ((reinterpret_cast<uintptr_t>(to) & 63) == 0) {
    _mm256_stream_si256(line, a);
    _mm256_stream_si256(line + 1, b);
  } else {
    _mm256_storeu_si256(line, a);
    _mm256_storeu_si256(line + 1, b);
  }
}

// 64-byte lines holding a 32-bit word of each of the 16 rows (bf16: a k-pair; int4: 8
// nibbles, see stage_int4; int8: 4 offset-binary bytes), 8 lines x 8 rows at a time through
// an 8 x 8 word transpose, each row's words stored contiguously (kNibbles: reordered into
// row-order nibbles; kOffsetBytes: q + 128 back to int8 q). Returns the lines done (a
// multiple of 8 of `lines`); the caller does the rest. Rows past dst.rows are padding:
// read, never written.
// Stores are non-temporal where aligned: the rows go to a staging buffer that the GPU's
// copy (on the CPU device, torch's expansion of the chunk) reads, not this core, so they
// skip the read for ownership and leave the caches alone. A streamed store should fill its
// cache line: half lines to 8 or 16 rows at once outrun the core's write-combining buffers
// (Zen 4: e4m3 staged in 1.8x the time of plain stores), so bf16 and int8 take 16 lines
// (64 bytes of each row) per step.
template <Word kWord>
__attribute__((target("avx2"))) int64_t untile_words_avx2(const uint8_t* block, int64_t lines, const BlockRows& dst,
                                                          size_t row_bytes) {
  constexpr int64_t kLine = 4 * kRows;
  const int64_t done = lines / 8 * 8;
  for (int half = 0; half < 2; ++half) {
    const int64_t rows = std::min<int64_t>(dst.rows - 8 * half, 8);
    if (rows <= 0) break;
    int64_t l = 0;
    if (kWord != Word::kNibbles)  // whole lines (int4's nibble reorder, slower that way, keeps 8 lines)
      for (; l + 16 <= done; l += 16) {
        __m256i t[8], u[8];
        load_transposed_8x8(block + l * kLine + 32 * half, kLine, t);
        load_transposed_8x8(block + (l + 8) * kLine + 32 * half, kLine, u);
        for (int64_t i = 0; i < rows; ++i) {
          store_line(dst.codes + (8 * half + i) * row_bytes + 4 * l, convert_words<kWord>(t[i]),
                     convert_words<kWord>(u[i]));
        }
      }
    for (; l < done; l += 8) {
      __m256i t[8];
      load_transposed_8x8(block + l * kLine + 32 * half, kLine, t);
      for (int64_t i = 0; i < rows; ++i) {
        const __m256i w = convert_words<kWord>(t[i]);
        __m256i* to = reinterpret_cast<__m256i*>(dst.codes + (8 * half + i) * row_bytes + 4 * l);
        if ((reinterpret_cast<uintptr_t>(to) & 31) == 0) _mm256_stream_si256(to, w);
        else _mm256_storeu_si256(to, w);
      }
    }
  }
  _mm_sfence();  // the streamed rows are visible before the job's end is
  return done;
}

// e4m3 lines (32 bytes: a 2-byte pair of each of the 16 rows), 32 lines x 16 rows at a
// time through two 16 x 16 transposes, so that each row gets a whole 64-byte line
// (streamed where aligned, as untile_words_avx2), then 16 lines; returns the pairs done (a
// multiple of 16).
__attribute__((target("avx2"))) int64_t untile_e4m3_avx2(const uint8_t* block, int64_t pairs, const BlockRows& dst,
                                                         size_t row_bytes) {
  constexpr int64_t kLine = 2 * kRows;
  int64_t p = 0;
  for (; p + 32 <= pairs; p += 32) {
    __m256i t[16], u[16];
    load_transposed_16x16_epi16(block + p * kLine, kLine, t);
    load_transposed_16x16_epi16(block + (p + 16) * kLine, kLine, u);
    for (int64_t i = 0; i < dst.rows; ++i) store_line(dst.codes + i * row_bytes + 2 * p, t[i], u[i]);
  }
  for (; p + 16 <= pairs; p += 16) {
    __m256i t[16];
    load_transposed_16x16_epi16(block + p * kLine, kLine, t);
    for (int64_t i = 0; i < dst.rows; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst.codes + i * row_bytes + 2 * p), t[i]);
  }
  _mm_sfence();  // the streamed rows are visible before the job's end is
  return p;
}

// 64-byte lines of 16 fp32 values (one per row of the block: the fp8 and int4 scales,
// [lines][16]) -> each row's `lines` values, contiguous at dst.codes + i * row_bytes: the
// same transpose as bf16's k-pair words.
void untile_fp32(const uint8_t* block, int64_t lines, const BlockRows& dst, size_t row_bytes) {
  const int64_t first = kHasAvx2 ? untile_words_avx2<Word::kAsIs>(block, lines, dst, row_bytes) : 0;
  for (int64_t i = 0; i < dst.rows; ++i)
    for (int64_t l = first; l < lines; ++l)
      std::memcpy(dst.codes + i * row_bytes + 4 * l, block + l * 4 * kRows + 4 * i, 4);
}

// Lines of k-pairs (bf16 and the e4m3 formats): line p holds, for each of the 16 rows i,
// elements 2p and 2p + 1 of `element` bytes each at byte 2 i element.
void untile_pairs(const uint8_t* block, int element, int64_t k, const BlockRows& dst, size_t row_bytes) {
  const int64_t line = 2 * kRows * element, pair = 2 * element;
  const int64_t first = !kHasAvx2     ? 0
                        : element == 2 ? untile_words_avx2<Word::kAsIs>(block, k / 2, dst, row_bytes)
                                       : untile_e4m3_avx2(block, k / 2, dst, row_bytes);
  for (int64_t i = 0; i < dst.rows; ++i) {
    uint8_t* d = dst.codes + i * row_bytes;
    const uint8_t* s = block + i * pair;
    for (int64_t p = first; p < k / 2; ++p) std::memcpy(d + p * pair, s + p * line, pair);
    if (k % 2) std::memcpy(d + (k / 2) * pair, s + (k / 2) * line, element);
  }
}

uint16_t bf16_truncated(const uint8_t* fp32) {
  uint32_t bits;
  std::memcpy(&bits, fp32, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// 2^(e - 127) as bf16 bits: e = 0 the subnormal 2^-127, 255 NaN.
uint16_t ue8m0_bf16(uint8_t e) {
  return e == mxfp4::kNanExponent ? 0x7fc0 : e == 0 ? 0x0040 : static_cast<uint16_t>(e << 7);
}

// fn(gate_up, b, block) for every 16-row block b of expert e's gate_up matrix, then of its
// down matrix, on the engine's threads.
template <class Fn>
void for_expert_blocks(const uint8_t* blob, const PackedLayout& layout, int64_t e, int64_t gate_up_blocks,
                       size_t gate_up_block_bytes, int64_t down_blocks, size_t down_block_bytes, Fn&& fn) {
  const uint8_t* gu = blob + layout.gate_up_offset + e * layout.gate_up_expert_bytes;
  const uint8_t* dn = blob + layout.down_offset + e * layout.down_expert_bytes;
  Engine::instance().parallel_for(gate_up_blocks + down_blocks, [&](int64_t job) {
    const bool gate_up = job < gate_up_blocks;
    const int64_t b = gate_up ? job : job - gate_up_blocks;
    fn(gate_up, b, gate_up ? gu + b * gate_up_block_bytes : dn + b * down_block_bytes);
  });
}

void stage_bf16(const uint8_t* blob, const PackedLayout& layout, int64_t e, const StagingRows& out) {
  const int64_t H = layout.shape.hidden_size, I = layout.shape.intermediate_size;
  const bf16_layout::Dims dims(H, I);
  for_expert_blocks(blob, layout, e, dims.gate_up_blocks, dims.gate_up_block_bytes(), dims.down_blocks,
                    dims.down_block_bytes(), [&](bool gate_up, int64_t b, const uint8_t* block) {
                      const int64_t k = gate_up ? H : I;
                      untile_pairs(block, 2, k, block_rows(out, gate_up, b, gate_up ? I : H, 2 * k, 0), 2 * k);
                    });
}

void stage_fp8(const uint8_t* blob, const PackedLayout& layout, int64_t e, const StagingRows& out) {
  const fp8_layout::Dims dims(layout.shape);
  const PackedFormat format = layout.shape.format;
  for_expert_blocks(blob, layout, e, dims.gate_up.blocks, dims.gate_up.block_bytes(), dims.down.blocks,
                    dims.down.block_bytes(), [&](bool gate_up, int64_t b, const uint8_t* block) {
    const fp8_layout::MatrixDims& m = gate_up ? dims.gate_up : dims.down;
    const size_t scale_bytes = m.byte_scales ? 1 : 4;
    const int64_t groups = format == PackedFormat::kFp8PerChannel ? 1 : m.groups;
    const BlockRows dst = block_rows(out, gate_up, b, m.rows, m.k, groups * scale_bytes);
    untile_pairs(block, 1, m.k, dst, m.k);
    const uint8_t* scales = block + m.scales_offset();  // [groups][16], fp32 or bytes
    if (scale_bytes == 4) return untile_fp32(scales, groups, {dst.scales, nullptr, dst.rows}, groups * 4);
    for (int64_t i = 0; i < dst.rows; ++i)
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(dst.scales + (i * groups + g) * scale_bytes, scales + (g * kRows + i) * scale_bytes, scale_bytes);
  });
}

void stage_int4(const uint8_t* blob, const PackedLayout& layout, int64_t e, const StagingRows& out) {
  const int_layout::Dims dims(layout.shape);
  for_expert_blocks(blob, layout, e, dims.gate_up.blocks, dims.gate_up.block_bytes(), dims.down.blocks,
                    dims.down.block_bytes(), [&](bool gate_up, int64_t b, const uint8_t* block) {
    const int_layout::MatrixDims& m = gate_up ? dims.gate_up : dims.down;
    // scales per row and group: bf16 (kt-kernel's), fp32, or int4_asym's fp32 (scale, minimum);
    // mxfp4: bf16 2^(e - 127), twice the stored half-scale (exact, NaN stays NaN)
    const bool mx = layout.shape.format == PackedFormat::kMxfp4;
    const size_t scale_bytes = m.minimums ? 8 : out.int4_fp32_scales && !mx ? 4 : 2;
    const BlockRows dst = block_rows(out, gate_up, b, m.rows, m.k / 2, m.groups * scale_bytes);
    const int64_t first = kHasAvx2 ? untile_words_avx2<Word::kNibbles>(block, m.lines, dst, m.k / 2) : 0;
    const bool fp32_scales = out.int4_fp32_scales && !mx && !m.minimums;  // [groups][16] fp32, transposed at once
    if (fp32_scales) untile_fp32(block + m.scales_offset(), m.groups, {dst.scales, nullptr, dst.rows}, m.groups * 4);
    for (int64_t i = 0; i < dst.rows; ++i) {
      // byte 4 i + j of line l: q(8 l + j) | q(8 l + 4 + j) << 4; out byte: k = 2 c low, 2 c + 1 high
      uint8_t* d = dst.codes + i * (m.k / 2);
      for (int64_t l = first; l < m.lines; ++l) {
        const uint8_t* s = block + l * int_layout::kLineBytes + 4 * i;
        d[4 * l + 0] = static_cast<uint8_t>((s[0] & 15) | (s[1] << 4));
        d[4 * l + 1] = static_cast<uint8_t>((s[2] & 15) | (s[3] << 4));
        d[4 * l + 2] = static_cast<uint8_t>((s[0] >> 4) | (s[1] & 0xf0));
        d[4 * l + 3] = static_cast<uint8_t>((s[2] >> 4) | (s[3] & 0xf0));
      }
      const uint8_t* scales = block + m.scales_offset() + i * 4;  // [groups][16] fp32
      const uint8_t* minimums = block + m.minimums_offset() + i * 4;
      if (mx) {
        auto* scale = reinterpret_cast<uint16_t*>(dst.scales + i * m.groups * 2);
        for (int64_t g = 0; g < m.groups; ++g) {
          uint16_t half;
          std::memcpy(&half, block + m.scales_offset() + g * m.scale_row_bytes + 2 * i, 2);
          const float value = 2.0f * bf16_to_float(half);  // exact: a power of two, or NaN
          scale[g] = bf16_truncated(reinterpret_cast<const uint8_t*>(&value));
        }
      } else if (fp32_scales) {  // written above
      } else if (out.int4_fp32_scales) {
        for (int64_t g = 0; g < m.groups; ++g) {
          uint8_t* to = dst.scales + (i * m.groups + g) * scale_bytes;
          std::memcpy(to, scales + g * kRows * 4, 4);
          if (m.minimums) std::memcpy(to + 4, minimums + g * kRows * 4, 4);
        }
      } else {
        auto* scale = reinterpret_cast<uint16_t*>(dst.scales + i * m.groups * 2);
        for (int64_t g = 0; g < m.groups; ++g) scale[g] = bf16_truncated(scales + g * kRows * 4);
      }
    }
  });
}

// int8 (not a kt-kernel staging layout: kt_ops' GPU prefill only): rows of int8 q (the
// stored q + 128 back), fp32 scales per row.
void stage_int8(const uint8_t* blob, const PackedLayout& layout, int64_t e, const StagingRows& out) {
  const int_layout::Dims dims(layout.shape);
  for_expert_blocks(blob, layout, e, dims.gate_up.blocks, dims.gate_up.block_bytes(), dims.down.blocks,
                    dims.down.block_bytes(), [&](bool gate_up, int64_t b, const uint8_t* block) {
    const int_layout::MatrixDims& m = gate_up ? dims.gate_up : dims.down;
    const BlockRows dst = block_rows(out, gate_up, b, m.rows, m.k, 4);
    // only lines wholly inside the real k: the rows are k bytes, no padding
    const int64_t first = kHasAvx2 ? 4 * untile_words_avx2<Word::kOffsetBytes>(block, m.k / 4, dst, m.k) : 0;
    for (int64_t i = 0; i < dst.rows; ++i) {
      uint8_t* d = dst.codes + i * m.k;
      for (int64_t k = first; k < m.k; ++k)
        d[k] = static_cast<uint8_t>(block[(k / 4) * int_layout::kLineBytes + 4 * i + k % 4] ^ 0x80);
      std::memcpy(dst.scales + i * 4, block + m.scales_offset() + i * 4, 4);
    }
  });
}

void stage_mxfp4(const uint8_t* blob, const PackedLayout& layout, int64_t e, const StagingRows& out) {
  const int64_t H = layout.shape.hidden_size, I = layout.shape.intermediate_size;
  const int64_t ks[3] = {H, H, I};  // row lengths of gate, up, down
  uint8_t* codes[3] = {out.gate, out.up, out.down};
  uint8_t* scales[3] = {out.gate_scale, out.up_scale, out.down_scale};
  const int64_t chunks = (2 * I + H + kRows - 1) / kRows;  // 16-row jobs over the three matrices
  Engine::instance().parallel_for(chunks, [&](int64_t job) {
    for (int64_t n = job * kRows; n < std::min<int64_t>((job + 1) * kRows, 2 * I + H); ++n) {
      const int m = n < I ? 0 : n < 2 * I ? 1 : 2;
      const int64_t row = n - (m == 0 ? 0 : m == 1 ? I : 2 * I), blocks = ks[m] / mxfp4::kBlockElems;
      const uint8_t* src = blob + layout.matrix_offset[m] + e * layout.matrix_expert_bytes[m] +
                           row * blocks * mxfp4::kBlockBytes;
      uint8_t* d = codes[m] + row * ks[m] / 2;
      auto* scale = reinterpret_cast<uint16_t*>(scales[m] + row * blocks * 2);
      for (int64_t blk = 0; blk < blocks; ++blk, src += mxfp4::kBlockBytes, d += 16) {
        const uint8_t* qs = src + 1;  // low nibble: weight j, high: j + 16 (ggml's order)
        for (int c = 0; c < 8; ++c) d[c] = static_cast<uint8_t>((qs[2 * c] & 15) | (qs[2 * c + 1] << 4));
        for (int c = 0; c < 8; ++c) d[8 + c] = static_cast<uint8_t>((qs[2 * c] >> 4) | (qs[2 * c + 1] & 0xf0));
        scale[blk] = ue8m0_bf16(src[0]);
      }
    }
  });
}

}  // namespace

StagingSizes staging_sizes(const PackedLayout& layout, bool int4_fp32_scales) {
  const PackedShape& s = layout.shape;
  const int64_t H = s.hidden_size, I = s.intermediate_size;
  StagingSizes sizes;
  sizes.intermediate = I;
  sizes.hidden = H;
  switch (s.format) {
    case PackedFormat::kBf16:
      sizes.gate_up_row = 2 * H, sizes.down_row = 2 * I;
      return sizes;
    case PackedFormat::kFp8:
    case PackedFormat::kFp8PerChannel:
    case PackedFormat::kMxfp8: {
      const fp8_layout::Dims dims(s);
      const bool per_channel = s.format == PackedFormat::kFp8PerChannel;
      const size_t scale = s.format == PackedFormat::kMxfp8 ? 1 : 4;
      sizes.gate_up_row = H, sizes.down_row = I;
      sizes.gate_up_scale_row = (per_channel ? 1 : dims.gate_up.groups) * scale;
      sizes.down_scale_row = (per_channel ? 1 : dims.down.groups) * scale;
      return sizes;
    }
    case PackedFormat::kInt8:
      sizes.gate_up_row = H, sizes.down_row = I;
      sizes.gate_up_scale_row = sizes.down_scale_row = 4;
      return sizes;
    case PackedFormat::kInt4Asym:  // kt_ops' GPU prefill only: (scale, minimum) fp32 pairs
      if (!int4_fp32_scales) break;
      [[fallthrough]];
    case PackedFormat::kMxfp4:  // kt-kernel's MXFP4 rows: bf16 scales whatever int4_fp32_scales says
    case PackedFormat::kInt4: {
      const size_t scale = s.format == PackedFormat::kInt4Asym                          ? 8
                           : int4_fp32_scales && s.format != PackedFormat::kMxfp4 ? 4
                                                                                    : 2;
      sizes.gate_up_row = H / 2, sizes.down_row = I / 2;
      sizes.gate_up_scale_row = H / s.group_size * scale, sizes.down_scale_row = I / s.group_size * scale;
      return sizes;
    }
    case PackedFormat::kGguf: {
      const uint32_t mxfp4 = static_cast<uint32_t>(GgmlType::kMxfp4);
      if (s.gguf_types[0] != mxfp4 || s.gguf_types[1] != mxfp4 || s.gguf_types[2] != mxfp4) break;
      sizes.gate_up_row = H / 2, sizes.down_row = I / 2;
      sizes.gate_up_scale_row = H / mxfp4::kBlockElems * 2, sizes.down_scale_row = I / mxfp4::kBlockElems * 2;
      return sizes;
    }
    default: break;
  }
  throw std::invalid_argument("this layer's format has no GPU staging layout (kt-kernel writes BF16, FP8, "
                              "FP8_PERCHANNEL, MXFP8, RAWINT4 and MXFP4 layers; a symmetric INT4 layer stages as "
                              "RAWINT4)");
}

void stage_expert_rows(const uint8_t* blob, size_t blob_bytes, int64_t expert, const StagingRows& out) {
  const PackedLayout layout = read_packed_header(blob, blob_bytes);
  staging_sizes(layout, out.int4_fp32_scales);  // throws for a layer with no staging layout
  if (expert < 0 || expert >= static_cast<int64_t>(layout.shape.num_experts))
    throw std::invalid_argument("expert " + std::to_string(expert) + " is not in this layer's " +
                                std::to_string(layout.shape.num_experts) + " packed experts");
  switch (layout.shape.format) {
    case PackedFormat::kBf16: return stage_bf16(blob, layout, expert, out);
    case PackedFormat::kInt8: return stage_int8(blob, layout, expert, out);
    case PackedFormat::kFp8:
    case PackedFormat::kFp8PerChannel:
    case PackedFormat::kMxfp8: return stage_fp8(blob, layout, expert, out);
    case PackedFormat::kInt4:
    case PackedFormat::kInt4Asym:
    case PackedFormat::kMxfp4: return stage_int4(blob, layout, expert, out);
    default: return stage_mxfp4(blob, layout, expert, out);  // gguf, MXFP4 x 3 (staging_sizes checked)
  }
}

}  // namespace kt::cpu
