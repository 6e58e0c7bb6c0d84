// [NOTE] ThreadTeam: whose threads run the Engine's parallel_for.
// csrc/cpu stays torch-free, so it cannot name torch's thread pool; the extension's
// module init (csrc/ops/torch_thread_team.cpp) installs torch's intra-op threads as the
// Engine's team. Then kt_ops and torch share one set of threads: the two pools no longer
// spin against each other for the same cores inside a model step, and
// torch.set_num_threads / kt_ops.set_num_threads are one number. Without a team (or with
// KT_OPS_THREAD_POOL=own) the Engine runs its own pinned WorkerPools (worker_pool.h).
#pragma once

#include "function_ref.h"

namespace kt::cpu {

class ThreadTeam {
 public:
  virtual ~ThreadTeam() = default;
  // Short description for diagnostics, e.g. "torch (OpenMP)".
  virtual const char* name() const = 0;
  virtual int num_threads() const = 0;
  virtual void set_num_threads(int n) = 0;
  // Calls body(w) once for every w in [0, workers) (workers <= num_threads()), on that many
  // threads of the team, the caller being one of them; returns when all have returned.
  // body must not throw.
  virtual void run(int workers, FunctionRef<void(int)> body) = 0;
};

}  // namespace kt::cpu
