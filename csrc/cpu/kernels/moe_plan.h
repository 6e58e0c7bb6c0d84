// [NOTE] Routing plan: the (token, slot) pairs of a call grouped by expert, so each
// expert's weights are streamed once for all the tokens routed to it. Slots with
// expert id -1 are skipped.
#pragma once

#include <cstdint>
#include <vector>

namespace kt::cpu {

struct MoePlan {
  int64_t num_pairs = 0;
  std::vector<int64_t> expert_begin;  // [E + 1]: pairs of expert e are [begin[e], begin[e+1])
  std::vector<int32_t> pair_token;    // [num_pairs]: token of each pair, grouped by expert
  std::vector<int32_t> pair_slot;     // [num_pairs]: its slot t * top_k + j
  std::vector<int32_t> slot_pair;     // [tokens * top_k]: pair of (t, j), or -1 if skipped
  std::vector<int32_t> active_experts;  // experts with at least one pair, ascending

  // Fills the plan from ids [tokens, top_k] (int32 or int64, values in [-1, E), checked
  // by the caller). Keeps the vectors' capacity for the next call.
  void build(const void* ids, bool ids_int64, int64_t tokens, int64_t top_k, int64_t experts);
};

}  // namespace kt::cpu
