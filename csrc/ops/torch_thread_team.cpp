// [NOTE] torch's intra-op threads as the engine's team.
// at::parallel_for is a header template: with torch's OpenMP backend its region is a
// `#pragma omp parallel` compiled into this file, which is why setup.py compiles with
// -fopenmp. The extension's DT_NEEDED libgomp.so.1 resolves to the copy torch has
// already loaded (same soname), so both run on one OpenMP runtime and one set of threads;
// tests/test_engine.py checks that the process maps a single libgomp and that kt_ops adds
// no threads of its own. With torch's native backend at::parallel_for calls into libtorch
// and no OpenMP is involved.
#include "torch_thread_team.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <stdexcept>

#include "../cpu/engine/engine.h"

namespace kt::ops {
namespace {

class TorchThreadTeam final : public cpu::ThreadTeam {
 public:
  const char* name() const override {
#if AT_PARALLEL_OPENMP
    return "torch intra-op threads (OpenMP)";
#else
    return "torch intra-op threads (native pool)";
#endif
  }
  int num_threads() const override { return at::get_num_threads(); }
  void set_num_threads(int n) override { at::set_num_threads(n); }
  void run(int workers, cpu::FunctionRef<void(int)> body) override {
    // Grain 1 over [0, workers): one index per thread when workers equals the team size.
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) body(static_cast<int>(w));
    });
  }
};

}  // namespace

void install_thread_team() {
  static TorchThreadTeam team;
  const char* choice = std::getenv("KT_OPS_THREAD_POOL");
  const std::string value = choice == nullptr ? "" : choice;
  if (value == "own") return cpu::Engine::instance().use_team(nullptr);
  if (!value.empty() && value != "torch")
    throw std::invalid_argument("KT_OPS_THREAD_POOL must be 'torch' (default: torch's intra-op threads) or "
                                "'own' (kt_ops' pinned pools), got '" + value + "'");
  cpu::Engine::instance().use_team(&team);
}

}  // namespace kt::ops
