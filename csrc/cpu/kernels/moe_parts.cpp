#include "moe_parts.h"

#include <algorithm>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "kernel_table.h"

namespace kt::cpu {
namespace {

constexpr int64_t kRowsPerJob = 16;        // reduced output rows per job
constexpr int64_t kColumnsPerStep = 256;   // fp32 sums on the stack per step

// out[offset, offset + n) = sum[0, n) in the output's element type.
void store_row(const float* sum, int64_t n, ElementType type, void* out, int64_t offset) {
  switch (type) {
    case ElementType::kF32:
      std::copy(sum, sum + n, static_cast<float*>(out) + offset);
      return;
    case ElementType::kBf16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[offset + i] = float_to_bf16(sum[i]);
      return;
    default:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[offset + i] = float_to_f16(sum[i]);
      return;
  }
}

}  // namespace

void moe_forward_parts(const MoeArgs& args, const std::vector<MoePart>& parts, float* partials,
                       CpuVariant variant) {
  const int64_t T = args.tokens, H = parts.front().layout.shape.hidden_size;
  const int64_t P = static_cast<int64_t>(parts.size());
  std::vector<int> nodes(P);
  for (int64_t p = 0; p < P; ++p) nodes[p] = parts[p].node;
  Engine& engine = Engine::instance();
  engine.run_on_nodes(nodes, [&](int64_t p) {
    MoeArgs part = args;
    part.packed = parts[p].packed;
    part.layout = parts[p].layout;
    part.output = partials + p * T * H;
    part.output_type = ElementType::kF32;
    moe_kernel(part.layout.shape.format, variant).forward(part);
  });
  // out[t] = ((partial_0[t] + partial_1[t]) + partial_2[t]) ..., rounded once.
  engine.parallel_for((T + kRowsPerJob - 1) / kRowsPerJob, [&](int64_t job) {
    float sum[kColumnsPerStep];
    for (int64_t t = job * kRowsPerJob; t < std::min(T, (job + 1) * kRowsPerJob); ++t)
      for (int64_t h0 = 0; h0 < H; h0 += kColumnsPerStep) {
        const int64_t n = std::min(kColumnsPerStep, H - h0);
        std::copy(partials + t * H + h0, partials + t * H + h0 + n, sum);
        for (int64_t p = 1; p < P; ++p) {
          const float* partial = partials + (p * T + t) * H + h0;
          for (int64_t h = 0; h < n; ++h) sum[h] += partial[h];
        }
        store_row(sum, n, args.output_type, args.output, t * H + h0);
      }
  });
}

}  // namespace kt::cpu
