// [NOTE] The INT8 / INT4 micro-GEMM, written once over a small set of integer vector
// operations each ISA provides (int_ops_avx512_vnni.h, int_ops_avx512.h, int_ops_avx2.h):
//
//   struct IntOps {
//     using Vec = ...;  using IReg = ...;       // fp32 vector ops, integer register
//     static constexpr int kRegsPerLine;        // registers per 64-byte line (1 or 2)
//     static constexpr int kMaxRows, kMaxRowsInt4;      // GEMM tile: token rows (int8, int4)
//     static constexpr int kMaxBlocks, kMaxBlocksInt4;  // and 16-column blocks
//     static constexpr int kDecodeRows;         // up to this many tokens stream (decode)
//     static constexpr int kInt8Bias;           // what dot_int8 adds: 128 * sum(a) or 0
//     IReg load(const uint8_t* line, int r);    // register r of a 64-byte line
//     IReg broadcast4(const int8_t* a);         // 4 activation bytes in every 32-bit lane
//     IReg low_nibbles(IReg), high_nibbles(IReg);
//     IReg high_nibbles_x16(IReg), shift_right4(IReg);  // 16 x high nibbles; int32 >> 4
//     IReg dot(IReg acc, IReg w_u8, IReg a_s8);       // acc + sum of 4 products, w < 16
//     IReg dot_int8(IReg acc, IReg w_u8, IReg a_s8);  // acc + sum (w - 128) a + kInt8Bias sum a
//     IReg add(IReg, IReg), set1(int32_t); Vec::Reg to_float(IReg); IReg zero();
//     IReg neg_shl(IReg v, int s);                // -(v << s) per int32 lane
//     // optional (kDotInt4 = true): acc + dot(lo, a0) + dot(hi, a1), one widening
//     static constexpr bool kDotInt4; IReg dot_int4(IReg acc, IReg lo, IReg a0, IReg hi, IReg a1);
//   };
//
// Activations are int8 rows a (per-token symmetric, scale applied by the driver) with
// their sums per 32 k (a_sums). tile<M, NB> computes for rows m < M, blocks b < NB:
//   c[m][16 b + n] (+)= sum_g scale[g][n] * (sum_{k in g} q(n, k) a[m][k] - z sum_{k in g} a[m][k])
//                       (+ minimum[g][n] * sum_{k in g} a[m][k])
// with int32 sums per group flushed to fp32 (int_layout.h has q, z, scale, minimum).
// MXFP4 is INT4 with a level table: each e2m1 code q becomes kValues[q] + 16 (one
// byte shuffle per register, levels 4..28, z = 16) and its bf16 half-scales are widened
// at the flush; everything else is INT4's arithmetic, except that its groups are added
// in spans of 512 k, each span into a partial of its own (mxfp4_span.h).
// INT8 has one scale per row; its sums are flushed every kInt8FlushK k (the last flush
// may be shorter). Batch invariance: every output lane sees the same flushes in the same
// order whatever M, NB and the k range the driver cuts the GEMM into (a range starts at
// a flush boundary and `accumulate` continues from c), so a token's result does not
// depend on how many rows share its tile or which path (decode, k-blocked) ran it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../formats/int_layout.h"
#include "mxfp4_span.h"
#include "../../isa/prefetch.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

enum class QuantKind { kInt8, kInt4, kInt4Asym, kMxfp4 };

// k per block of the driver's k-blocked GEMM (quant_format.h's quant_k_block) and per
// int32 flush of INT8 sums (QuantGemm::kInt8FlushK): 512 for MXFP4 and the AVX2-width
// variants (a multiple of every int4 group), 2048 where a weight line is one register.
constexpr int64_t kQuantKBlock = 512;
constexpr int64_t kQuantWideKBlock = 2048;

// GCC's vpdpbusd / vpdpwssd intrinsics make its register allocator copy every accumulator
// around each dot (a 6 x 4 int8 tile loop: 131 register moves and stack spills for 24
// vpdpbusd, and 2 moves per dot in the 4 x 2 tile; its vdpbf16ps intrinsic compiles
// cleanly). The VNNI operations therefore issue the instruction as inline assembly with
// the accumulator as a read-write operand, which compiles to the dots alone; other
// compilers get the intrinsics.
#if defined(__GNUC__) && !defined(__clang__)
#define KT_VNNI_INLINE_ASM 1
#else
#define KT_VNNI_INLINE_ASM 0
#endif

// acc + per int32 lane the 4 products u8(w) x s8(a) (vpdpbusd; 256-bit: the VEX form of
// AVX-VNNI) or the 2 products s16 x s16 (vpdpwssd, 512-bit), as one instruction in
// assembly. Templates, so a translation unit without the ISA never instantiates them.
template <class IReg>
inline IReg asm_dpbusd(IReg acc, IReg w, IReg a) {
  if constexpr (sizeof(IReg) == 64)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
  else
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
  return acc;
}

template <class IReg>
inline IReg asm_dpwssd(IReg acc, IReg a, IReg b) {
  static_assert(sizeof(IReg) == 64, "vpdpwssd: AVX512_VNNI only");
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

struct QuantTileArgs {
  const int8_t* const* a;        // [M] activation row pointers at the tile's first k
  const int32_t* const* a_sums;  // [M] pointers to the rows' sums per 32 k, same first k
  const uint8_t* w;              // block 0's first line in this k range
  const float* scales;           // block 0's scale row of the range's first group (mxfp4: bf16 values)
  const float* minimums;         // same for int4_asym (nullptr otherwise)
  int64_t block_stride;          // bytes between consecutive blocks (lines and scales)
  int64_t k;                     // k to accumulate: a multiple of group (int8: any multiple of 32)
  int64_t group;                 // k per flush: int4's group; int8: QuantGemm::kInt8FlushK (one scale row)
  float* c;                      // [M][ldc] fp32 output tile, NB * 16 columns used
  int64_t ldc;
  bool accumulate;               // add to c instead of overwriting it
  int64_t prefetch;              // lines ahead to prefetch (0: none; decode streams DRAM)
  // Line l of `stream_blocks` blocks from `stream` (block_stride apart) to L2 at line l:
  // prefill, the next k block of one block; decode, the job's next tile of blocks, with
  // their scale (and minimum) rows at each group's start (stream_scales).
  const uint8_t* stream = nullptr;
  int stream_blocks = 1;
  bool stream_scales = false;
  // Decode: block 0 of the job's next tile of blocks (the same layout), where the last
  // `prefetch` lines of this tile prefetch the first of that one's (prefetch_line).
  const uint8_t* next_tile = nullptr;
  // int4_asym with integer zero points (MatrixDims::integer_zeros): each group's sums start
  // at -z * a_sum per lane (z = -minimum / scale), so the flush is symmetric int4's.
  bool integer_zeros = false;
};

// Activation rows for a GEMM: int8 levels and their sums per 32 k.
struct QuantRows {
  const int8_t* levels;
  int64_t stride;  // bytes between rows
  const int32_t* sums;
  int64_t sums_stride;  // int32 between rows
};

inline int32_t load_i32(const void* p) {
  int32_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// Ops with dot_int4(acc, lo, a0, hi, a1) (kDotInt4): one widening for a line's two nibble products.
template <class Ops, class = void>
struct HasDotInt4 : std::false_type {};
template <class Ops>
struct HasDotInt4<Ops, std::void_t<decltype(Ops::kDotInt4)>> : std::bool_constant<Ops::kDotInt4> {};

template <class Ops, QuantKind Kind>
struct QuantGemm {
  using Vec = typename Ops::Vec;
  using IReg = typename Ops::IReg;
  using FReg = typename Vec::Reg;
  static constexpr bool kInt4 = Kind != QuantKind::kInt8;
  static constexpr int kMaxRows = kInt4 ? Ops::kMaxRowsInt4 : Ops::kMaxRows;
  static constexpr int kDecodeRows = Ops::kDecodeRows;
  static constexpr int kMaxBlocks = kInt4 ? Ops::kMaxBlocksInt4 : Ops::kMaxBlocks;
  // Decode tiles (few rows, every group flushed once per token) stay kMaxBlocks wide:
  // 2-block INT4 tiles took 64-token S1 AMXINT4 to 1.21x the time.
  static constexpr int kDecodeBlocks = Ops::kMaxBlocks;
  static constexpr int R = Ops::kRegsPerLine;
  static constexpr int W = Vec::kWidth;  // 16 / R
  // k per int32 flush of INT8 sums; the INT8 k block of the driver's GEMM (quant_format.h).
  // AVX-512 (one register per line): 2048. A k-blocked row tile of 6 x 4 blocks runs
  // 128 line steps per 512 k, and what it does around them (sums started, flushed through
  // c, the next call set up) cost ~15% beside them: a C++ harness calling
  // quant_gemm_rows on S1's matrices (36 token rows, weights in DRAM, one core, Zen 5,
  // 2026-12-02) ran gate/up at 5.7-6.0 vpdpbusd per ns with 512, 6.0-6.6 with 2048 (a
  // 2048 k block flushed every 512: 5.8-5.9) and down (K = 768, blocks of 512 + 256) at
  // 4.8-5.1 against 5.7-5.9 (one k block). 2048 k of int8 x uint8 products stays far
  // inside int32 (2048 x 127 x 255 < 2^26). The 4 blocks' 2048 k (128 KiB) stay in L2 for
  // the later row tiles instead of L1 (Zen 5: 1 MiB L2). AVX2 (two registers per line, tiles
  // of 2 rows that re-read each k block T / 2 times, and Zen 3's 512 KiB L2) keeps 512.
  static constexpr int64_t kInt8FlushK = R == 1 ? kQuantWideKBlock : kQuantKBlock;
  static constexpr int kKPerLine = kInt4 ? 8 : 4;
  // AVX2 (int_ops_avx2.h): vpmaddubsw pair sums (dot_int4) in 16 registers of 8 int32.
  static constexpr bool kAvx2Dots = HasDotInt4<Ops>::value && R == 2;
  // What the integer sums carry per unit of sum(a): 128 (int8 offset binary, when the
  // dot keeps it), 8 (symmetric int4), 16 (mxfp4's levels), 0 (asymmetric int4: handled
  // by the minimum).
  static constexpr int32_t kBias = Kind == QuantKind::kInt8    ? Ops::kInt8Bias
                                   : Kind == QuantKind::kInt4  ? int_layout::kInt4Zero
                                   : Kind == QuantKind::kMxfp4 ? int_layout::kMxfp4LevelBias
                                                               : 0;
  static constexpr bool kMxfp4 = Kind == QuantKind::kMxfp4;
  // AVX-512 VNNI int4 lines (not MXFP4's, whose table lookup follows): one load per line and
  // two ANDs of the register. GCC folded the load into both ANDs, two 64-byte loads of each
  // line beside the tile's prefetches on Zen 4's load ports. Paired A/B (2-core Zen 4,
  // avx512_bf16, scripts/ab_pair.py with a run-time switch in one build, 2 rounds of 12
  // calls, 2026-12-05), 1 / 8 tokens: S1 AMXINT4 0.92-0.99 / 0.94-0.99 of the time, S2
  // GPTQ_INT4 0.87-0.98 / 0.73-0.98, S1 RAWINT4 0.90-0.97 / 0.91-1.02, S2 AWQ_INT4 0.96 /
  // 0.97; 64 tokens 0.96-1.03, 512 0.99 (the same operations: bit-identical). Left as GCC
  // compiles them: avx512's dot_int4 lines (1.02-1.2, noisy), AVX2's (1.00), MXFP4 (1.01).
  static constexpr bool kOneLoad = R == 1 && !HasDotInt4<Ops>::value && !kMxfp4;
  // Bytes between a block's scale rows of consecutive groups (int_layout.h).
  static constexpr int64_t kScaleRowBytes =
      kMxfp4 ? static_cast<int64_t>(int_layout::kMxfp4ScaleRowBytes) : static_cast<int64_t>(int_layout::kLineBytes);

  // MXFP4: codes (0..15 per byte) -> their levels kValues[q] + 16 (mxfp4_block.h kLevels).
  static IReg mxfp4_levels(IReg codes) {
    const auto* table = reinterpret_cast<const __m128i*>(mxfp4::kLevels.bytes);
    if constexpr (sizeof(IReg) == 32)
      return _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table)), codes);
    else
      return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(table)), codes);
  }

  // The fp32 scales of register r of group g's scale row at `row` (int4: fp32, mxfp4: bf16).
  static FReg load_scales(const uint8_t* row, int r) {
    if constexpr (kMxfp4) return Vec::load_bf16(reinterpret_cast<const uint16_t*>(row) + r * W);
    else return Vec::load(reinterpret_cast<const float*>(row) + r * W);
  }

  // Tiles of more registers of sums than this (12 of AVX-512's 32 registers, 8 of AVX2's
  // 16) keep their fp32 accumulators in c (L1-resident, touched once per group) and give
  // the registers to the sums; the fp32 arithmetic is the same either way. INT4's groups
  // of 32 flush every 4 lines, so its AVX512_VNNI tile (6 x 2) keeps both in registers.
  template <int M, int NB>
  static constexpr bool kAccInMemory = M * NB * R > (R == 1 ? 12 : 8);

  // Always inlined into the driver's GEMM loops (quant_format.h): as a function of its own
  // the tile re-reads t's fields and tests its prefetch options on every line (an out-of-
  // line 6 x 4 INT4 tile took 512-token S1 AMXINT4 to 1.15x the time).
  template <int M, int NB>
  __attribute__((always_inline)) static void tile(const QuantTileArgs& t) {
    constexpr bool kInMemory = kAccInMemory<M, NB>;
    // MXFP4: acc (or span_mem) holds the current span's partial sum, c the total.
    FReg acc[kInMemory ? 1 : M][kInMemory ? 1 : NB][R];
    alignas(64) float span_mem[kMxfp4 && kInMemory ? M : 1][kMxfp4 && kInMemory ? NB * 16 : 1];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) {
          float* c = t.c + m * t.ldc + b * 16 + r * W;
          if constexpr (kMxfp4) {
            if (!t.accumulate) Vec::store(c, Vec::zero());
            if constexpr (kInMemory) Vec::store(&span_mem[m][b * 16 + r * W], Vec::zero());
            else acc[m][b][r] = Vec::zero();
          } else if constexpr (kInMemory) {
            if (!t.accumulate) Vec::store(c, Vec::zero());
          } else {
            acc[m][b][r] = t.accumulate ? Vec::load(c) : Vec::zero();
          }
        }
    const int64_t n_lines = t.k / kKPerLine;
    for (int64_t g = 0, k0 = 0; k0 < t.k; ++g, k0 += t.group) {
      const int64_t group_k = std::min(t.group, t.k - k0);
      // Decode (one or two rows) would chain every dot of a block on one register's
      // latency; int4 then keeps the high nibbles' sums apart (no measurable change on
      // this memory-bound machine; it costs nothing). Not on AVX2 (dot_int4 with 16
      // registers): its chain is one vpaddd, and the second set of sums made the 1 x 4
      // decode tile spill (and reload) sums and decoded lines on every line; without it,
      // paired A/B on Zen 3 (2026-12-02, 2 rounds of 16 calls), 1 / 8 / 512 tokens: S1
      // RAWINT4 0.83 / 0.87 / 0.77 of the time, S1 AMXINT4 0.80 / 0.82 / 0.78, S2
      // GPTQ_INT4 0.90 / 0.82 / 0.80, S1 MXFP4 0.94 / 0.84 / 0.85 (bit-identical: int32 sums).
      constexpr bool kSplit = kInt4 && M <= 2 && !kAvx2Dots;
      // Split decode sums of plain int4 codes on vpdpbusd (no int16 pair sums) take the high
      // nibbles in place, 16 x their level, and divide their sum by 16 at the flush
      // (exact: a multiple of 16): one shift less per line and block. Bit-identical; paired
      // A/B against the shift (Zen 5, avx512_bf16, 1 token, 30 calls, 2026-11-27): S1
      // RAWINT4 / AMXINT4, S2 GPTQ_INT4 0.97-0.99 of the time in one calm run; other runs
      // were inside the spread between two processes (scripts/ab_pair.py).
      constexpr bool kHighX16 = kSplit && !kMxfp4 && !HasDotInt4<Ops>::value;  // no dot_int4: vpdpbusd
      if (t.stream_scales) {  // the streamed blocks have the tile's layout: same offsets
        const int64_t group_at = Kind == QuantKind::kInt8 ? 0 : g * kScaleRowBytes;
        const int64_t scales_at = reinterpret_cast<const uint8_t*>(t.scales) - t.w + group_at;
        const int64_t minimums_at =
            t.minimums != nullptr ? reinterpret_cast<const uint8_t*>(t.minimums) - t.w + group_at : -1;
        for (int b = 0; b < t.stream_blocks; ++b) {
          const char* block = reinterpret_cast<const char*>(t.stream + b * t.block_stride);
          if (Kind != QuantKind::kInt8 || g == 0) prefetch_l2(block + scales_at);
          if (minimums_at >= 0) prefetch_l2(block + minimums_at);
        }
      }
      // Each row's activation sum over the group. The sums start at -kBias * a_sum, so the
      // flush converts them as they are (the same int32 values as subtracting afterwards).
      int32_t a_sum[M];
      IReg starts[M];
      const bool vector_start = kVectorStart && group_k == int_layout::kKAlign;
      if (vector_start) vector_starts<M>(t, k0 / int_layout::kKAlign, starts);
      else group_sums<M>(t, k0, group_k, a_sum);
      IReg sums[M][NB][R], high_sums[M][NB][R];
      IReg negative_zeros[Kind == QuantKind::kInt4Asym ? NB : 1][R];
      const bool integer_zeros = Kind == QuantKind::kInt4Asym && t.integer_zeros;
      if (integer_zeros)
        for (int b = 0; b < NB; ++b) {
          const uint8_t* scale = reinterpret_cast<const uint8_t*>(t.scales) + b * t.block_stride + g * kScaleRowBytes;
          const float* minimum =
              reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(t.minimums) + b * t.block_stride) + g * 16;
          for (int r = 0; r < R; ++r)
            negative_zeros[b][r] = Ops::negative_zeros(Vec::load(minimum + r * W), load_scales(scale, r));
        }
      for (int m = 0; m < M; ++m) {
        const IReg start = vector_start ? starts[m] : kBias != 0 ? Ops::set1(-kBias * a_sum[m]) : Ops::zero();
        for (int b = 0; b < NB; ++b)
          for (int r = 0; r < R; ++r) {
            sums[m][b][r] = integer_zeros ? Ops::mul(negative_zeros[b][r], Ops::set1(a_sum[m])) : start;
            high_sums[m][b][r] = Ops::zero();
          }
      }
      const int64_t first_line = k0 / kKPerLine;
      for (int64_t l = first_line; l < first_line + group_k / kKPerLine; ++l) {
        const int64_t k = l * kKPerLine;
        const uint8_t* pf_line = prefetch_line(t, l, n_lines);
        if (t.stream != nullptr)
          for (int b = 0; b < t.stream_blocks; ++b)
            prefetch_l2(t.stream + b * t.block_stride + l * 64);
        if constexpr (kInt4) {
          const uint8_t* line0 = t.w + l * 64;
          // AVX2's one-row decode tile dots each block as soon as it is unpacked: 8 sums,
          // 4 unpacked registers, 2 broadcasts and 2 constants fit 16 registers, where
          // unpacking all 4 blocks first spilled 6 of the sums on every line. Paired A/B
          // (Zen 3, 2026-12-02, 2 rounds of 16 calls), 1 / 8 tokens: S1 RAWINT4 0.89 /
          // 0.97 of the time, S1 AMXINT4 0.92 / 0.97, S2 GPTQ_INT4 0.88 / 0.94, S1 MXFP4
          // 0.79 / 0.91 (the same sums in the same order: bit-identical).
          constexpr bool kInTurn = kAvx2Dots && M == 1;
          IReg lo[NB][R], hi[NB][R], x0 = Ops::zero(), x1 = Ops::zero();
          if constexpr (kInTurn) {
            x0 = Ops::broadcast4(t.a[0] + k);
            x1 = Ops::broadcast4(t.a[0] + k + 4);
          }
          for (int b = 0; b < NB; ++b) {
            if (t.prefetch > 0) prefetch_ahead(pf_line + b * t.block_stride);
            for (int r = 0; r < R; ++r) {
              IReg v = Ops::load(line0 + b * t.block_stride, r);
              if constexpr (kOneLoad) asm volatile("" : "+v"(v));  // one load, two ANDs of the register
              lo[b][r] = nibble_levels(Ops::low_nibbles(v));
              hi[b][r] = kHighX16 ? Ops::high_nibbles_x16(v) : nibble_levels(Ops::high_nibbles(v));
              if constexpr (kInTurn) sums[0][b][r] = Ops::dot_int4(sums[0][b][r], lo[b][r], x0, hi[b][r], x1);
            }
          }
          for (int m = 0; m < M && !kInTurn; ++m) {
            const IReg a0 = Ops::broadcast4(t.a[m] + k), a1 = Ops::broadcast4(t.a[m] + k + 4);
            for (int b = 0; b < NB; ++b)
              for (int r = 0; r < R; ++r) {
                if constexpr (HasDotInt4<Ops>::value) {
                  // Few rows chain every dot of a block on one register: odd lines
                  // accumulate apart.
                  IReg& acc = kSplit && (l & 1) ? high_sums[m][b][r] : sums[m][b][r];
                  acc = Ops::dot_int4(acc, lo[b][r], a0, hi[b][r], a1);
                } else {
                  sums[m][b][r] = Ops::dot(sums[m][b][r], lo[b][r], a0);
                  if constexpr (kSplit)  // two dependency chains where few rows give few
                    high_sums[m][b][r] = Ops::dot(high_sums[m][b][r], hi[b][r], a1);
                  else
                    sums[m][b][r] = Ops::dot(sums[m][b][r], hi[b][r], a1);
                }
              }
          }
        } else {
          IReg w[NB][R];
          for (int b = 0; b < NB; ++b) {
            const uint8_t* line = t.w + b * t.block_stride + l * 64;
            if (t.prefetch > 0) prefetch_ahead(pf_line + b * t.block_stride);
            for (int r = 0; r < R; ++r) w[b][r] = Ops::load(line, r);
          }
          for (int m = 0; m < M; ++m) {
            const IReg a = Ops::broadcast4(t.a[m] + k);
            for (int b = 0; b < NB; ++b)
              for (int r = 0; r < R; ++r) sums[m][b][r] = Ops::dot_int8(sums[m][b][r], w[b][r], a);
          }
        }
      }
      if constexpr (kSplit)
        for (int m = 0; m < M; ++m)
          for (int b = 0; b < NB; ++b)
            for (int r = 0; r < R; ++r) {
              const IReg high = kHighX16 ? Ops::shift_right4(high_sums[m][b][r]) : high_sums[m][b][r];
              sums[m][b][r] = Ops::add(sums[m][b][r], high);
            }
      if constexpr (kMxfp4) {
        flush_span_group<M, NB>(t, g, sums, acc, span_mem);
        if (g % kMxfp4SpanGroups == kMxfp4SpanGroups - 1 || k0 + group_k >= t.k) end_span<M, NB>(t, acc, span_mem);
      } else {
        flush_group<M, NB>(t, g, a_sum, sums, acc);
      }
    }
    if constexpr (!kInMemory && !kMxfp4)
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < NB; ++b)
          for (int r = 0; r < R; ++r) Vec::store(t.c + m * t.ldc + b * 16 + r * W, acc[m][b][r]);
  }

 private:
  // Block 0's line `prefetch` lines after line l: in this tile or, past its last line
  // (n_lines), in the next tile's blocks, whose streams then start warm instead of with
  // `prefetch` demand misses each. Measured with a run-time switch, both settings
  // interleaved call by call in one process (two builds' processes differ by more than
  // this: scripts/ab_pair.py), Zen 5, avx512_bf16, 2026-11-27, 20-40 calls: 1 and 8
  // tokens S1 RAWINT4 0.93-0.94 of the time, AMXINT4 0.95, AMXINT8 0.94-0.96; S2 (longer
  // blocks) GPTQ_INT4 / AWQ_INT4 1.01, MXFP4 / AMXINT8 0.99. Prefetching the int4 scale
  // rows ahead too gained nothing (alone 1.005-1.009 of the time, with this 0.95-0.97).
  // A line `prefetch` lines ahead: to L2 with AVX-512 registers, to L1 with AVX2's. On a
  // 2-core Zen 4 (avx512_bf16, 2026-12-04, scripts/ab_pair.py with a run-time switch, one
  // build, 8-20 calls per row; the same bits) L2 took 1 and 8 tokens S1/S2 AMXINT4 to
  // 0.87-0.91 of the time, S1 AMXINT8 0.92-0.94, 64 tokens AMXINT4 / AMXINT8 / S2 GPTQ_INT4
  // 0.83 / 0.92 / 0.91, 512 tokens 0.99-1.01: an L1 prefetch holds a fill buffer until the line
  // arrives, so 4 streams 32 lines ahead kept too few lines in flight. Forced to avx2 it read
  // 0.96-1.04 (AMXINT4 slower, AMXINT8 faster): AVX2 keeps L1. Zen 5 and the Intel Xeons were
  // not measured with it. Decode on CPUs whose PREFETCHT1 fills L1 (AMD before Zen 4) asks for
  // none (t.prefetch 0: quant_format.h's quant_gemm_rows).
  // As inline assembly (isa/prefetch.h): GCC 12.2 dropped the `_mm_prefetch` here from most tile instances
  // (the 1- and 2-block one-token tiles, INT8's 2-4 row decode tiles, int4_asym's 2-4 row
  // ones: no prefetch instruction, t.prefetch never read; only the 1 x 4 tile kept it).
  // Paired A/B against the intrinsic (2-core Zen 4, avx512_bf16, 2026-12-05, scripts/ab_pair.py
  // --a <previous build>, 2 rounds of 10-12 calls; bandwidth ~36 GB/s, the same bits): 8 tokens
  // on one thread S1 AMXINT8 0.90-0.97 of the time, AMXINT4 0.99; two threads, 1 / 8 tokens,
  // S1 AMXINT4, S1 AMXINT8 (8) and S2 GPTQ_INT4 0.96-1.01; 64 / 512 tokens (the k-blocked
  // GEMM's first row tile lost it too) S1 AMXINT8 0.97 / 1.01-1.02, AMXINT4 0.93-0.98 / 0.98.
  static void prefetch_ahead(const uint8_t* line) {
    if constexpr (R == 1) prefetch_l2(line);
    else prefetch_l1(line);
  }

  static const uint8_t* prefetch_line(const QuantTileArgs& t, int64_t l, int64_t n_lines) {
    const int64_t ahead = l + t.prefetch;
    if (t.next_tile != nullptr && ahead >= n_lines) return t.next_tile + (ahead - n_lines) * 64;
    return t.w + ahead * 64;
  }

  // A line's codes (0..15) as the levels the dots multiply: themselves, MXFP4's table.
  static IReg nibble_levels(IReg codes) {
    if constexpr (kMxfp4) return mxfp4_levels(codes);
    else return codes;
  }

  // Groups of 32 of symmetric int4 and MXFP4 (kBias a power of two; the flush needs no
  // activation sum): row m's start -kBias * a_sum is its one sum per 32 k broadcast
  // straight from memory, shifted and negated in the vector register (the same int32
  // values as the scalar product broadcast, which went through the stack). Measured in
  // one process, both ways interleaved call by call (Zen 5, 2026-11-27, 24 calls):
  // 512-token S1 RAWINT4 0.95-0.97 of the time on avx512_bf16, 0.99 on avx_vnni, 1.00 on
  // avx2; MXFP4 0.985-0.996; 1-64 tokens 0.985-1.005. Larger groups keep the scalar sum
  // (GPTQ_INT4's groups of 128 summed so, four broadcasts and adds on the vector ports:
  // 1.02 of the time).
  static constexpr bool kVectorStart = Kind == QuantKind::kInt4 || Kind == QuantKind::kMxfp4;
  static constexpr int kBiasShift = kBias == 16 ? 4 : 3;
  static_assert(!kVectorStart || kBias == (1 << kBiasShift), "the vector start shifts by log2(kBias)");

  template <int M>
  static void vector_starts(const QuantTileArgs& t, int64_t sum_index, IReg (&starts)[M]) {
    for (int m = 0; m < M; ++m)
      starts[m] = Ops::neg_shl(Ops::broadcast4(reinterpret_cast<const int8_t*>(t.a_sums[m] + sum_index)), kBiasShift);
  }

  // a_sum[m] = row m's activation sum over k in [k0, k0 + group_k) (from its sums per 32 k).
  template <int M>
  static void group_sums(const QuantTileArgs& t, int64_t k0, int64_t group_k, int32_t (&a_sum)[M]) {
    const int64_t first_sum = k0 / int_layout::kKAlign;
    const int64_t n_sums = group_k / int_layout::kKAlign;
    // The int4 group sizes get loops of a known length (a loop of n_sums per row and group
    // took about a tenth of a groups-of-32 GEMM).
    switch (n_sums) {
      case 1: return add_sums<M, 1>(t, first_sum, n_sums, a_sum);
      case 2: return add_sums<M, 2>(t, first_sum, n_sums, a_sum);
      case 4: return add_sums<M, 4>(t, first_sum, n_sums, a_sum);
      default: return add_sums<M, 0>(t, first_sum, n_sums, a_sum);
    }
  }

  // add_sums<M, N>: N sums per row (N = 0: n_sums, known only at run time).
  template <int M, int N>
  static void add_sums(const QuantTileArgs& t, int64_t first_sum, int64_t n_sums, int32_t (&a_sum)[M]) {
    const int64_t n = N > 0 ? N : n_sums;
    for (int m = 0; m < M; ++m) {
      int32_t sum = 0;
      for (int64_t s = 0; s < n; ++s) sum += t.a_sums[m][first_sum + s];
      a_sum[m] = sum;
    }
  }

  // MXFP4: acc (or span_mem) += group g's sums x its half-scales, the span's partial
  // (mxfp4_span.h); end_span adds it to c and starts the next one from +0.
  template <int M, int NB, class Acc, class Mem>
  static void flush_span_group(const QuantTileArgs& t, int64_t g, IReg (&sums)[M][NB][R], Acc& acc, Mem& span_mem) {
    constexpr bool kInMemory = kAccInMemory<M, NB>;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const uint8_t* scale = reinterpret_cast<const uint8_t*>(t.scales) + b * t.block_stride + g * kScaleRowBytes;
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          const FReg s = load_scales(scale, r);
          if constexpr (kInMemory) {
            float* p = &span_mem[m][b * 16 + r * W];
            Vec::store(p, Vec::fma(Ops::to_float(sums[m][b][r]), s, Vec::load(p)));
          } else {
            acc[m][b][r] = Vec::fma(Ops::to_float(sums[m][b][r]), s, acc[m][b][r]);
          }
        }
      }
    }
  }

  template <int M, int NB, class Acc, class Mem>
  static void end_span(const QuantTileArgs& t, Acc& acc, Mem& span_mem) {
    constexpr bool kInMemory = kAccInMemory<M, NB>;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          float* c = t.c + m * t.ldc + b * 16 + r * W;
          if constexpr (kInMemory) {
            float* p = &span_mem[m][b * 16 + r * W];
            Vec::store(c, Vec::add(Vec::load(c), Vec::load(p)));
            Vec::store(p, Vec::zero());
          } else {
            Vec::store(c, Vec::add(Vec::load(c), acc[m][b][r]));
            acc[m][b][r] = Vec::zero();
          }
        }
  }

  // acc += group g's int32 sums (already unbiased: they started at -kBias * a_sum, or
  // -z * a_sum) scaled to fp32; int4_asym without integer zeros adds minimum * a_sum first.
  template <int M, int NB, class Acc>
  static void flush_group(const QuantTileArgs& t, int64_t g, const int32_t (&a_sum)[M], IReg (&sums)[M][NB][R],
                          Acc& acc) {
    constexpr bool kInMemory = kAccInMemory<M, NB>;
    // Unrolled, so the sums stay in their registers (a loop over m indexes them in memory).
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const uint8_t* scale = reinterpret_cast<const uint8_t*>(t.scales) + b * t.block_stride +
                               (Kind == QuantKind::kInt8 ? 0 : g * kScaleRowBytes);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          const FReg s = load_scales(scale, r);
          float* c = t.c + m * t.ldc + b * 16 + r * W;
          FReg v;
          if constexpr (kInMemory) v = Vec::load(c); else v = acc[m][b][r];
          if (Kind == QuantKind::kInt4Asym && !t.integer_zeros) {
            const float* minimum = reinterpret_cast<const float*>(
                reinterpret_cast<const uint8_t*>(t.minimums) + b * t.block_stride) + g * 16;
            v = Vec::fma(Vec::set1(static_cast<float>(a_sum[m])), Vec::load(minimum + r * W), v);
          }
          v = Vec::fma(Ops::to_float(sums[m][b][r]), s, v);
          if constexpr (kInMemory) Vec::store(c, v); else acc[m][b][r] = v;
        }
      }
    }
  }
};

}  // namespace
}  // namespace kt::cpu
