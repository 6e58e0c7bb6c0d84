#include "gguf_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "gguf_types.h"
#include "mxfp4_block.h"
#include "source_rows.h"

namespace kt::cpu {
namespace {

constexpr int kQK = 256;  // K-quant super-block

void put_f16(uint8_t* p, float v) {
  const uint16_t h = float_to_f16(v);
  std::memcpy(p, &h, 2);
}

// The element of largest magnitude, with its sign (the first one on ties).
float signed_extreme(const float* x, int n) {
  float amax = 0.0f, extreme = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      extreme = x[i];
    }
  return extreme;
}

int nearest(float v) { return static_cast<int>(std::nearbyint(v)); }

float f16_round(float v) { return f16_to_float(float_to_f16(v)); }

// --- 32-element blocks (ggml's reference quantizers) ---

// Q4_0 (18 bytes): f16 d, 16 bytes: element j in the low nibble of byte j, j + 16 in
// the high nibble; w = d * (q - 8).
void q4_0(const float* x, uint8_t* b) {
  const float d = signed_extreme(x, 32) / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>(std::trunc(x[j] * id + 8.5f)));
    const int hi = std::min(15, static_cast<int>(std::trunc(x[j + 16] * id + 8.5f)));
    b[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// Q4_1 (20 bytes): f16 d, f16 m, nibbles as Q4_0; w = d * q + m.
void q4_1(const float* x, uint8_t* b) {
  const float lo = *std::min_element(x, x + 32), hi = *std::max_element(x, x + 32);
  const float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  put_f16(b + 2, lo);
  for (int j = 0; j < 16; ++j) {
    const int q0 = std::min(15, static_cast<int>(std::trunc((x[j] - lo) * id + 0.5f)));
    const int q1 = std::min(15, static_cast<int>(std::trunc((x[j + 16] - lo) * id + 0.5f)));
    b[4 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
}

// 5-bit levels q[32] -> 4 bytes of high bits (bit j = bit 4 of q[j]) and 16 nibble bytes.
void put_5bit(const int* q, uint8_t* qh, uint8_t* qs) {
  uint32_t high = 0;
  for (int j = 0; j < 32; ++j) high |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
  std::memcpy(qh, &high, 4);
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 15) | ((q[j + 16] & 15) << 4));
}

// Q5_0 (22 bytes): f16 d, u32 high bits, 16 nibble bytes; w = d * (q - 16).
void q5_0(const float* x, uint8_t* b) {
  const float d = signed_extreme(x, 32) / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = std::min(31, static_cast<int>(std::trunc(x[j] * id + 16.5f)));
  put_f16(b, d);
  put_5bit(q, b + 2, b + 6);
}

// Q5_1 (24 bytes): f16 d, f16 m, u32 high bits, 16 nibble bytes; w = d * q + m.
void q5_1(const float* x, uint8_t* b) {
  const float lo = *std::min_element(x, x + 32), hi = *std::max_element(x, x + 32);
  const float d = (hi - lo) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = std::min(31, static_cast<int>(std::trunc((x[j] - lo) * id + 0.5f)));
  put_f16(b, d);
  put_f16(b + 2, lo);
  put_5bit(q, b + 4, b + 8);
}

// Q8_0 (34 bytes): f16 d, 32 int8; w = d * q.
void q8_0(const float* x, uint8_t* b) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
}

// --- 256-element super-blocks: round-to-nearest sub-block scales ---

// Sub-blocks of n elements with unsigned levels [0, levels] and a minimum:
// x ~ scale[j] * q - minimum[j] with minimum >= 0 (the range always includes 0).
void range_fit(const float* x, int n, int levels, float& scale, float& minimum) {
  const float lo = std::min(0.0f, *std::min_element(x, x + n));
  const float hi = *std::max_element(x, x + n);
  scale = (hi - lo) / static_cast<float>(levels);
  minimum = -lo;
}

// Quantizes sub-block scales / minimums (all >= 0) to integers [0, max_level] with one
// fp16 super-scale each; returns the fp16-rounded super-scales through d / dmin.
void quantize_scales(const float* values, int n, int max_level, int* levels, float& d) {
  const float top = *std::max_element(values, values + n);
  d = f16_round(top / static_cast<float>(max_level));
  for (int j = 0; j < n; ++j) levels[j] = d > 0.0f ? std::clamp(nearest(values[j] / d), 0, max_level) : 0;
}

// Signed sub-block scales -> int levels in [-max_level - 1, max_level] with one fp16
// super-scale (returned through d).
void quantize_signed_scales(const float* values, int n, int max_level, int* levels, float& d) {
  float top = 0.0f;
  for (int j = 0; j < n; ++j) top = std::max(top, std::fabs(values[j]));
  d = f16_round(top / static_cast<float>(max_level));
  for (int j = 0; j < n; ++j)
    levels[j] = d > 0.0f ? std::clamp(nearest(values[j] / d), -max_level - 1, max_level) : 0;
}

// Level of x for w = step * q - offset, clamped to [lo, hi] (0 when step is 0).
int level(float x, float step, float offset, int lo, int hi) {
  return step > 0.0f || step < 0.0f ? std::clamp(nearest((x + offset) / step), lo, hi) : 0;
}

// Asymmetric K-quant sub-blocks: n_sub sub-blocks of `size` with levels [0, levels];
// integer scales / minimums in [0, max_level] with fp16 d, dmin. Fills q[256].
void fit_asymmetric(const float* x, int n_sub, int size, int levels, int max_level, int* sc, int* m,
                    float& d, float& dmin, int* q) {
  float scale[16], minimum[16];
  for (int j = 0; j < n_sub; ++j) range_fit(x + j * size, size, levels, scale[j], minimum[j]);
  quantize_scales(scale, n_sub, max_level, sc, d);
  quantize_scales(minimum, n_sub, max_level, m, dmin);
  for (int e = 0; e < kQK; ++e)
    q[e] = level(x[e], d * sc[e / size], dmin * m[e / size], 0, levels);
}

// Q2_K (84 bytes): scales[16] (scale | min << 4), qs[64], f16 d, f16 dmin; 16 sub-blocks
// of 16; element e = 128 n + 32 j + l is bits 2j of qs[32 n + l]; w = d*sc*q - dmin*m.
void q2_k(const float* x, uint8_t* b) {
  int sc[16], m[16], q[kQK];
  float d, dmin;
  fit_asymmetric(x, 16, 16, 3, 15, sc, m, d, dmin, q);
  std::memset(b, 0, 84);
  for (int j = 0; j < 16; ++j) b[j] = static_cast<uint8_t>(sc[j] | (m[j] << 4));
  for (int e = 0; e < kQK; ++e) b[16 + 32 * (e / 128) + e % 32] |= static_cast<uint8_t>(q[e] << (2 * (e % 128 / 32)));
  put_f16(b + 80, d);
  put_f16(b + 82, dmin);
}

// 6-bit scales and minimums of Q4_K / Q5_K into their 12 bytes (ggml's get_scale_min_k4).
void put_scale_min_k4(const int* sc, const int* m, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
  }
}

// Q4_K (144 bytes): f16 d, f16 dmin, scales[12], qs[128]; 8 sub-blocks of 32; element
// e = 64 c + 32 h + l is nibble h of qs[32 c + l]; w = d*sc*q - dmin*m.
void q4_k(const float* x, uint8_t* b) {
  int sc[8], m[8], q[kQK];
  float d, dmin;
  fit_asymmetric(x, 8, 32, 15, 63, sc, m, d, dmin, q);
  std::memset(b, 0, 144);
  put_f16(b, d);
  put_f16(b + 2, dmin);
  put_scale_min_k4(sc, m, b + 4);
  for (int e = 0; e < kQK; ++e) b[16 + 32 * (e / 64) + e % 32] |= static_cast<uint8_t>(q[e] << (4 * (e % 64 / 32)));
}

// Q5_K (176 bytes): as Q4_K plus qh[32] before qs: bit 4 of element e = 64 c + 32 h + l
// is bit 2c + h of qh[l].
void q5_k(const float* x, uint8_t* b) {
  int sc[8], m[8], q[kQK];
  float d, dmin;
  fit_asymmetric(x, 8, 32, 31, 63, sc, m, d, dmin, q);
  std::memset(b, 0, 176);
  put_f16(b, d);
  put_f16(b + 2, dmin);
  put_scale_min_k4(sc, m, b + 4);
  for (int e = 0; e < kQK; ++e) {
    const int c = e / 64, h = e % 64 / 32, l = e % 32;
    b[48 + 32 * c + l] |= static_cast<uint8_t>((q[e] & 15) << (4 * h));
    b[16 + l] |= static_cast<uint8_t>((q[e] >> 4) << (2 * c + h));
  }
}

// Q3_K (110 bytes): hmask[32], qs[64], scales[12] (16 6-bit scales, +32), f16 d; 16
// sub-blocks of 16; element e = 128 n + 32 j + l: low bits 2j of qs[32 n + l], high
// bit 4n + j of hmask[l]; w = d * (sc - 32) * (q - 4).
void q3_k(const float* x, uint8_t* b) {
  float scale[16];
  int sc[16];
  for (int j = 0; j < 16; ++j) scale[j] = signed_extreme(x + 16 * j, 16) / -4.0f;
  float d;
  quantize_signed_scales(scale, 16, 31, sc, d);
  std::memset(b, 0, 110);
  for (int e = 0; e < kQK; ++e) {
    const int u = level(x[e], d * sc[e / 16], 0.0f, -4, 3) + 4;
    const int n = e / 128, j = e % 128 / 32, l = e % 32;
    b[32 + 32 * n + l] |= static_cast<uint8_t>((u & 3) << (2 * j));
    b[l] |= static_cast<uint8_t>((u >> 2) << (4 * n + j));
  }
  uint8_t* s = b + 96;
  int v[16];
  for (int j = 0; j < 16; ++j) v[j] = sc[j] + 32;
  for (int k = 0; k < 8; ++k) s[k] = static_cast<uint8_t>((v[k] & 15) | ((v[k + 8] & 15) << 4));
  for (int k = 0; k < 4; ++k)
    s[8 + k] = static_cast<uint8_t>((v[k] >> 4) | ((v[k + 4] >> 4) << 2) | ((v[k + 8] >> 4) << 4) |
                                    ((v[k + 12] >> 4) << 6));
  put_f16(b + 108, d);
}

// Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d; 16 sub-blocks of 16;
// element e = 128 n + 32 p + l: nibble p / 2 of ql[64 n + 32 (p % 2) + l], bits 2p of
// qh[32 n + l]; w = d * sc * (q - 32).
void q6_k(const float* x, uint8_t* b) {
  float scale[16];
  int sc[16];
  for (int j = 0; j < 16; ++j) scale[j] = signed_extreme(x + 16 * j, 16) / -32.0f;
  float d;
  quantize_signed_scales(scale, 16, 127, sc, d);
  std::memset(b, 0, 210);
  for (int e = 0; e < kQK; ++e) {
    const int u = level(x[e], d * sc[e / 16], 0.0f, -32, 31) + 32;
    const int n = e / 128, p = e % 128 / 32, l = e % 32;
    b[64 * n + 32 * (p % 2) + l] |= static_cast<uint8_t>((u & 15) << (4 * (p / 2)));
    b[128 + 32 * n + l] |= static_cast<uint8_t>((u >> 4) << (2 * p));
  }
  for (int j = 0; j < 16; ++j) b[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(sc[j]));
  put_f16(b + 208, d);
}

}  // namespace

void gguf_quantize_row(uint32_t type, const float* x, int64_t k, uint8_t* out) {
  const GgmlTypeInfo& info = ggml_type_info(type);
  ggml_row_bytes(type, static_cast<uint64_t>(k), "gguf_quantize_row");
  using Block = void (*)(const float*, uint8_t*);
  Block block = nullptr;
  switch (info.type) {
    case GgmlType::kF32: std::memcpy(out, x, k * sizeof(float)); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < k; ++i) {
        const uint16_t h = float_to_f16(x[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case GgmlType::kBf16:
      for (int64_t i = 0; i < k; ++i) {
        const uint16_t h = float_to_bf16(x[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case GgmlType::kQ4_0: block = q4_0; break;
    case GgmlType::kQ4_1: block = q4_1; break;
    case GgmlType::kQ5_0: block = q5_0; break;
    case GgmlType::kQ5_1: block = q5_1; break;
    case GgmlType::kQ8_0: block = q8_0; break;
    case GgmlType::kMxfp4: block = mxfp4::quantize_block; break;
    case GgmlType::kQ2_K: block = q2_k; break;
    case GgmlType::kQ3_K: block = q3_k; break;
    case GgmlType::kQ4_K: block = q4_k; break;
    case GgmlType::kQ5_K: block = q5_k; break;
    case GgmlType::kQ6_K: block = q6_k; break;
  }
  for (int64_t i = 0; i < k / info.block_elems; ++i) block(x + i * info.block_elems, out + i * info.block_bytes);
}

void pack_gguf_experts(const void* gate, const void* up, const void* down, ElementType source,
                       const PackedLayout& layout, const QuantOptions& /*options*/, uint8_t* blob) {
  constexpr int64_t kRowsPerJob = 16;
  const int64_t E = layout.shape.num_experts, H = layout.shape.hidden_size,
                I = layout.shape.intermediate_size;
  const void* sources[3] = {gate, up, down};
  const int64_t rows[3] = {I, I, H}, cols[3] = {H, H, I};
  int64_t jobs_before[4] = {0};
  for (int m = 0; m < 3; ++m) jobs_before[m + 1] = jobs_before[m] + E * ((rows[m] + kRowsPerJob - 1) / kRowsPerJob);
  std::memset(blob, 0, layout.total_bytes);
  write_packed_header(layout, blob);
  Engine::instance().parallel_for(jobs_before[3], [&](int64_t job) {
    int m = 0;
    while (job >= jobs_before[m + 1]) ++m;
    const int64_t per_expert = (rows[m] + kRowsPerJob - 1) / kRowsPerJob;
    const int64_t local = job - jobs_before[m], expert = local / per_expert;
    const int64_t row0 = local % per_expert * kRowsPerJob;
    const uint64_t row_bytes = layout.matrix_expert_bytes[m] / rows[m];
    thread_local std::vector<float> row;
    row.resize(cols[m]);
    for (int64_t r = row0; r < std::min(rows[m], row0 + kRowsPerJob); ++r) {
      load_row(sources[m], source, expert * rows[m] + r, cols[m], row.data());
      gguf_quantize_row(layout.shape.gguf_types[m], row.data(), cols[m],
                        blob + layout.matrix_offset[m] + expert * layout.matrix_expert_bytes[m] + r * row_bytes);
    }
  });
}

}  // namespace kt::cpu
