#include "moe_plan.h"

#include <algorithm>

namespace kt::cpu {

void MoePlan::build(const void* ids, bool ids_int64, int64_t tokens, int64_t top_k,
                    int64_t experts) {
  const int64_t slots = tokens * top_k;
  auto id_at = [&](int64_t slot) -> int64_t {
    return ids_int64 ? static_cast<const int64_t*>(ids)[slot]
                     : static_cast<const int32_t*>(ids)[slot];
  };
  expert_begin.assign(experts + 1, 0);
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t expert = id_at(slot);
    if (expert >= 0) ++expert_begin[expert + 1];
  }
  active_experts.clear();
  for (int64_t e = 0; e < experts; ++e) {
    if (expert_begin[e + 1] > 0) active_experts.push_back(static_cast<int32_t>(e));
    expert_begin[e + 1] += expert_begin[e];
  }
  num_pairs = expert_begin[experts];
  pair_token.resize(num_pairs);
  pair_slot.resize(num_pairs);
  slot_pair.resize(slots);
  std::vector<int64_t>& next = expert_begin;  // reuse as a cursor, then restore
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t expert = id_at(slot);
    if (expert < 0) {
      slot_pair[slot] = -1;
      continue;
    }
    const int64_t pair = next[expert]++;
    pair_token[pair] = static_cast<int32_t>(slot / top_k);
    pair_slot[pair] = static_cast<int32_t>(slot);
    slot_pair[slot] = static_cast<int32_t>(pair);
  }
  // next[e] now equals the old begin[e + 1]; shift back.
  for (int64_t e = experts; e > 0; --e) expert_begin[e] = expert_begin[e - 1];
  expert_begin[0] = 0;
}

}  // namespace kt::cpu
