#include "dequantize_gguf.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "../isa/scalar_convert.h"
#include "gguf_types.h"
#include "mxfp4_block.h"

namespace kt::cpu {
namespace {

// Block layouts: ggml-common.h (block_q4_0 ... block_q6_K); d, dmin, m are fp16.
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// A row of `blocks` blocks of a type -> blocks * block_elems floats.
using DecodeRowFn = void (*)(const uint8_t* row, int64_t blocks, float* out);

void decode_f32(const uint8_t* b, float* out) { std::memcpy(out, b, 4); }
void decode_f16(const uint8_t* b, float* out) { *out = f16_at(b); }
void decode_bf16(const uint8_t* b, float* out) {
  uint16_t h;
  std::memcpy(&h, b, 2);
  *out = bf16_to_float(h);
}

// Q4_0 / Q5_0: d * (q - offset); Q4_1 / Q5_1: d * q + m. Byte j of qs: weight j (low
// nibble), weight j + 16 (high); Q5: bit j of the 32-bit qh is bit 4 of weight j.
template <bool kFiveBit, bool kHasMin>
void decode_q45_01(const uint8_t* b, float* out) {
  constexpr int kQs = 2 + (kHasMin ? 2 : 0) + (kFiveBit ? 4 : 0);
  const float d = f16_at(b);
  const float m = kHasMin ? f16_at(b + 2) : 0.0f;
  uint32_t qh = 0;
  if (kFiveBit) std::memcpy(&qh, b + kQs - 4, 4);
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 16; ++j) {
      const int e = 16 * half + j;
      int q = (b[kQs + j] >> (4 * half)) & 15;
      if (kFiveBit) q |= static_cast<int>((qh >> e) & 1) << 4;
      if (kHasMin) {
        const float product = d * static_cast<float>(q);
        out[e] = product + m;
      } else {
        out[e] = d * static_cast<float>(q - (kFiveBit ? 16 : 8));
      }
    }
}

void decode_q8_0(const uint8_t* b, float* out) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

void decode_mxfp4(const uint8_t* b, float* out) { mxfp4::decode_block(b, out); }

// Weight e = 128 h + 32 j + l of Q2_K and Q3_K: bits 2j of byte 32 h + l of qs; sub-block
// e / 16 = 8 h + 2 j + l / 16 (the loops run over sub-blocks, 16 weights each).
void decode_q2_k(const uint8_t* b, float* out) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  float dl[16], ml[16];
  for (int i = 0; i < 16; ++i) {
    dl[i] = d * static_cast<float>(scales[i] & 15);
    ml[i] = dmin * static_cast<float>(scales[i] >> 4);
  }
  for (int sub = 0; sub < 16; ++sub) {  // weights 16 sub: h = sub / 8, j = sub / 2 % 4, l = 16 (sub % 2) + i
    const int h = sub / 8, j = sub / 2 % 4, l0 = 16 * (sub % 2);
    for (int i = 0; i < 16; ++i) {
      const float product = dl[sub] * static_cast<float>((qs[32 * h + l0 + i] >> (2 * j)) & 3);
      out[16 * sub + i] = product - ml[sub];
    }
  }
}

// Q3_K: as Q2_K, minus 4 where bit 4h + j of hmask[l] is clear; dl = d * (6-bit scale - 32).
void decode_q3_k(const uint8_t* b, float* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* s = b + 96;
  const float d = f16_at(b + 108);
  float dl[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    dl[i] = d * static_cast<float>((low | high << 4) - 32);
  }
  for (int sub = 0; sub < 16; ++sub) {
    const int h = sub / 8, j = sub / 2 % 4, l0 = 16 * (sub % 2);
    for (int i = 0; i < 16; ++i) {
      const int low = (qs[32 * h + l0 + i] >> (2 * j)) & 3;
      const int clear = ((hmask[l0 + i] >> (4 * h + j)) & 1) ^ 1;
      out[16 * sub + i] = dl[sub] * static_cast<float>(low - 4 * clear);
    }
  }
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

// Weight e = 64 c + 32 h + l of Q4_K / Q5_K: nibble h of byte 32 c + l of qs (Q5_K: bit
// 2c + h of qh[l] is bit 4); sub-block 2c + h: (d * sc) * q - dmin * m.
template <bool kFiveBit>
void decode_q45_k(const uint8_t* b, float* out) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kFiveBit ? 48 : 16);
  for (int sub = 0; sub < 8; ++sub) {
    int sc, m;
    scale_min_k4(sub, b + 4, sc, m);
    const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
    const int c = sub / 2, h = sub % 2;
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * c + l] >> (4 * h)) & 15;
      if (kFiveBit) q |= ((qh[l] >> sub) & 1) << 4;
      const float product = ds * static_cast<float>(q);
      out[32 * sub + l] = product - dm;
    }
  }
}

// Weight e = 128 h + 32 j + l (as ggml's dequantize_row_q6_K): low 4 bits: nibble j / 2 of
// ql[64 h + 32 (j % 2) + l]; high 2 bits: bits 2j of qh[32 h + l]; (d * scale[e / 16]) * (q - 32).
void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  float ds[16];
  for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(scales[i]);
  for (int sub = 0; sub < 16; ++sub) {
    const int h = sub / 8, j = sub / 2 % 4, l0 = 16 * (sub % 2);
    for (int i = 0; i < 16; ++i) {
      const int low = (ql[64 * h + 32 * (j % 2) + l0 + i] >> (4 * (j / 2))) & 15;
      const int high = (qh[32 * h + l0 + i] >> (2 * j)) & 3;
      out[16 * sub + i] = ds[sub] * static_cast<float>((low | high << 4) - 32);
    }
  }
}

// kDecode (one block -> kElems floats) over a row, inlined.
template <void (*kDecode)(const uint8_t*, float*), int kElems, int kBytes>
void decode_row(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t i = 0; i < blocks; ++i) kDecode(row + i * kBytes, out + i * kElems);
}

DecodeRowFn row_decoder(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return decode_row<decode_f32, 1, 4>;
    case GgmlType::kF16: return decode_row<decode_f16, 1, 2>;
    case GgmlType::kBf16: return decode_row<decode_bf16, 1, 2>;
    case GgmlType::kQ4_0: return decode_row<decode_q45_01<false, false>, 32, 18>;
    case GgmlType::kQ4_1: return decode_row<decode_q45_01<false, true>, 32, 20>;
    case GgmlType::kQ5_0: return decode_row<decode_q45_01<true, false>, 32, 22>;
    case GgmlType::kQ5_1: return decode_row<decode_q45_01<true, true>, 32, 24>;
    case GgmlType::kQ8_0: return decode_row<decode_q8_0, 32, 34>;
    case GgmlType::kMxfp4: return decode_row<decode_mxfp4, mxfp4::kBlockElems, mxfp4::kBlockBytes>;
    case GgmlType::kQ2_K: return decode_row<decode_q2_k, 256, 84>;
    case GgmlType::kQ3_K: return decode_row<decode_q3_k, 256, 110>;
    case GgmlType::kQ4_K: return decode_row<decode_q45_k<false>, 256, 144>;
    case GgmlType::kQ5_K: return decode_row<decode_q45_k<true>, 256, 176>;
    case GgmlType::kQ6_K: return decode_row<decode_q6_k, 256, 210>;
  }
  throw std::invalid_argument("dequantize_gguf_rows: no decoder for ggml type " +
                              std::to_string(static_cast<uint32_t>(type)));
}

}  // namespace

void dequantize_gguf_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                          int64_t row_begin, int64_t row_end, float* out) {
  const int m = static_cast<int>(matrix);
  const GgmlTypeInfo& type = ggml_type_info(layout.shape.gguf_types[m]);
  const DecodeRowFn decode = row_decoder(type.type);
  const int64_t K = matrix_cols(layout, matrix);
  const int64_t blocks = K / type.block_elems, row_bytes = blocks * type.block_bytes;
  const uint8_t* row = blob + layout.matrix_offset[m] + expert * layout.matrix_expert_bytes[m] + row_begin * row_bytes;
  for (int64_t r = row_begin; r < row_end; ++r, row += row_bytes, out += K) decode(row, blocks, out);
}

}  // namespace kt::cpu
