// [NOTE] The BF16 packed layout, shared by every ISA (AVX2, AVX-512, AVX512_BF16, AMX):
// weights are stored in blocks of 16 output rows; within a block, for each pair of
// input columns (k, k+1), the 16 rows' two values sit side by side:
//   block [K/2][16][2] bf16 = K/2 lines of 64 bytes.
// One 64-byte line is one vdpbf16ps operand (16 outputs x 2 inputs), two AVX2 loads,
// and one row of an AMX B tile (16 consecutive lines form a tile), so every ISA reads
// the same bytes. Rows and columns past the matrix are zero.
//   gate_up expert: [I16/16][2 (gate, up)][Hp][16][2]   Hp  = ceil(H / 2)
//   down expert:    [H16/16][I16/2][16][2]              I16 = round_up(I, 16)
// Interleaving gate and up blocks lets one pass over the stream produce matching gate
// and up outputs for the SiLU-and-multiply epilogue.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::cpu::bf16_layout {

constexpr int kBlockRows = 16;
constexpr size_t kLineBytes = 64;  // one k-pair of one block

constexpr int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Dimensions of the packed matrices of a layer with hidden size H, intermediate I.
struct Dims {
  int64_t hidden = 0;             // H
  int64_t intermediate = 0;       // I
  int64_t hidden_pairs = 0;       // Hp: k-pairs of gate/up (input H, padded to even)
  int64_t intermediate16 = 0;     // I16: intermediate rows padded to a block
  int64_t hidden16 = 0;           // H16: down output rows padded to a block
  int64_t gate_up_blocks = 0;     // 2 * I16 / 16 (gate and up interleaved)
  int64_t down_blocks = 0;        // H16 / 16
  int64_t down_pairs = 0;         // I16 / 2: k-pairs of down

  constexpr Dims(int64_t h, int64_t i)
      : hidden(h),
        intermediate(i),
        hidden_pairs((h + 1) / 2),
        intermediate16(round_up(i, kBlockRows)),
        hidden16(round_up(h, kBlockRows)),
        gate_up_blocks(2 * round_up(i, kBlockRows) / kBlockRows),
        down_blocks(round_up(h, kBlockRows) / kBlockRows),
        down_pairs(round_up(i, kBlockRows) / 2) {}

  constexpr size_t gate_up_block_bytes() const { return hidden_pairs * kLineBytes; }
  constexpr size_t down_block_bytes() const { return down_pairs * kLineBytes; }
  constexpr size_t gate_up_expert_bytes() const { return gate_up_blocks * gate_up_block_bytes(); }
  constexpr size_t down_expert_bytes() const { return down_blocks * down_block_bytes(); }
};

}  // namespace kt::cpu::bf16_layout
