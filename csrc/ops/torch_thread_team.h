// Hands the CPU engine torch's intra-op threads (csrc/cpu/engine/thread_team.h).
#pragma once

#include <string>

namespace kt::ops {

// Installs torch's intra-op threads as the engine's team, unless KT_OPS_THREAD_POOL=own
// (kt_ops' own pinned pools). Throws std::invalid_argument for any other value. Called
// once, when kt_ops._C is imported.
void install_thread_team();

}  // namespace kt::ops
