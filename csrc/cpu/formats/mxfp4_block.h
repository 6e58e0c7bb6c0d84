// [NOTE] MXFP4 blocks as GGUF stores them (ggml type 39, GGML_TYPE_MXFP4; OCP MX
// "MXFP4" in ggml's byte order): 32 weights along k in 17 bytes,
//   byte 0       e, the block's shared E8M0 exponent
//   bytes 1-16   e2m1 codes: byte 1 + j = code of weight j (low nibble)
//                                        | code of weight j + 16 (high nibble) << 4
//   w = kValues[code] * half_scale(e),  half_scale(e) = 2^(e - 127) / 2
// kValues are the e2m1 values doubled ({0, 0.5, 1, 1.5, 2, 3, 4, 6} x 2, codes 8-15
// negative, 8 = -0 read as 0), so with the halved scale they are small integers: the
// kernels dot them as int8 levels (kernels/gguf/). e = 255 is NaN, as the OCP MX spec
// defines it (ggml reads it as 2^127); e = 0 and 1 give the subnormal scales 2^-128 and
// 2^-127. The quantizer never writes 255.
//
// Hugging Face checkpoints (gpt-oss, DeepSeek-V4-Flash) store the same codes with
// another nibble order (byte j = weights 2j | 2j + 1 << 4) and the exponents in a
// separate tensor; kt_ops/hf_mxfp4.py repacks them into these blocks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kt::cpu::mxfp4 {

constexpr int kBlockElems = 32;
constexpr int kBlockBytes = 17;
constexpr uint8_t kNanExponent = 255;

// Doubled e2m1 values by code (ggml's kvalues_mxfp4).
constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Format mxfp4's kernels dot code q as the unsigned level kValues[q] + kLevelBias (4..28)
// (int_layout.h); kLevels holds them twice, one byte-shuffle table per 128-bit lane.
constexpr int kLevelBias = 16;
struct LevelTable {
  int8_t bytes[32];
};
constexpr LevelTable level_table() {
  LevelTable table{};
  for (int i = 0; i < 32; ++i) table.bytes[i] = static_cast<int8_t>(kValues[i % 16] + kLevelBias);
  return table;
}
inline constexpr LevelTable kLevels = level_table();

// fp32 bits of half_scale(e) = 2^(e - 128): e >= 2 a normal float, e = 0, 1 subnormal,
// 255 a quiet NaN.
constexpr uint32_t half_scale_bits(uint8_t e) {
  return e == kNanExponent ? 0x7fc00000u : e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
}

inline float half_scale(uint8_t e) {
  const uint32_t bits = half_scale_bits(e);
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// One block -> 32 floats.
inline void decode_block(const uint8_t* block, float* out) {
  const float d = half_scale(block[0]);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(kValues[block[1 + j] & 15]);
    out[j + 16] = d * static_cast<float>(kValues[block[1 + j] >> 4]);
  }
}

// The code nearest to x / d (d = half_scale(e)), ties to the smaller magnitude and +0
// for zero: the first index of least |kValues[i] * d - x|, as ggml's best_index_mxfp4
// scans them (those differences are exact in fp32, so comparing |x| / d, computed
// exactly in double, against the midpoints picks the same code).
inline uint8_t nearest_code(float x, float d) {
  const double m = std::fabs(static_cast<double>(x)) / static_cast<double>(d);
  // Midpoints between the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (codes 0-7).
  constexpr double kMid[7] = {0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0};
  uint8_t code = 0;
  while (code < 7 && m > kMid[code]) ++code;
  return code != 0 && x < 0.0f ? static_cast<uint8_t>(code | 8) : code;
}

// 32 floats -> one block, as ggml's quantize_row_mxfp4_ref (and gguf.quants) for finite ones:
// e = floor(log2f(max|x|)) - 2 + 127 (0 for an all-zero block), so max|x| / d lies in
// [8, 16) and codes saturate at 12; then each weight's nearest code. log2f, not the
// exact exponent, on purpose: for max|x| a few ulps below a power of two it rounds up
// to the power, and so does ggml. A block whose max|x| is below 2^-125 gets e = 0
// (ggml's cast would wrap); weights past 12 * d saturate. A block holding a NaN or an
// infinity becomes the NaN block (e = 255, codes 0): MXFP4's only non-finite value.
inline void quantize_block(const float* x, uint8_t* block) {
  float amax = 0.0f;
  for (int j = 0; j < kBlockElems; ++j) {
    if (!std::isfinite(x[j])) {
      block[0] = kNanExponent;
      std::memset(block + 1, 0, kBlockBytes - 1);
      return;
    }
    if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
  }
  int e = amax > 0.0f ? static_cast<int>(std::floor(std::log2(amax))) - 2 + 127 : 0;
  e = e < 0 ? 0 : e > 254 ? 254 : e;
  block[0] = static_cast<uint8_t>(e);
  const float d = half_scale(static_cast<uint8_t>(e));
  for (int j = 0; j < 16; ++j)
    block[1 + j] = static_cast<uint8_t>(nearest_code(x[j], d) | nearest_code(x[j + 16], d) << 4);
}

}  // namespace kt::cpu::mxfp4
