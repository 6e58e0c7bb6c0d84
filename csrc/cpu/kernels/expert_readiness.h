// [NOTE] Per-expert readiness for the MoE driver's single parallel region (moe_driver.h):
// how many of an expert's gate/up jobs are still to finish, then whether its intermediate
// rows are prepared for down. The driver's gate/up jobs precede its down jobs in job
// order, and the engine hands out jobs in that order (Job::work), so a down job only
// ever waits for gate/up jobs another thread has already started: it cannot wait for
// ever, and running the jobs inline one after another never waits at all.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>

namespace kt::cpu {

class ExpertReadiness {
 public:
  // Every expert of [0, experts) not ready, with no job counted; before the region.
  void reset(int64_t experts) {
    if (capacity_ < experts) {
      state_.reset(new std::atomic<int32_t>[experts]);
      capacity_ = experts;
    }
    for (int64_t e = 0; e < experts; ++e) state_[e].store(0, std::memory_order_relaxed);
  }
  // One more gate/up job of expert e; before the region.
  void add_job(int64_t e) { state_[e].fetch_add(1, std::memory_order_relaxed); }

  // Runs one gate/up job of expert e (work); the thread that finishes e's last one runs
  // prepare (e's rows for down) and marks e ready. A job that throws still counts as
  // finished (e is marked ready, unprepared, so no down job waits for ever), and the
  // exception goes on to the engine, which rethrows it after the region.
  template <class Work, class Prepare>
  void finish_one(int64_t e, Work&& work, Prepare&& prepare) {
    std::exception_ptr error;
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    if (state_[e].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (!error) {
        try {
          prepare();
        } catch (...) {
          error = std::current_exception();
        }
      }
      state_[e].store(kReady, std::memory_order_release);
    }
    if (error) std::rethrow_exception(error);
  }

  // Returns once expert e is ready (its rows written and prepared by other threads are
  // then visible to this one).
  void wait(int64_t e) const {
    for (uint32_t spins = 1; state_[e].load(std::memory_order_acquire) != kReady; ++spins) {
      if (spins % 1024 == 0) std::this_thread::yield();
      else __builtin_ia32_pause();
    }
  }

 private:
  static constexpr int32_t kReady = -1;
  std::unique_ptr<std::atomic<int32_t>[]> state_;
  int64_t capacity_ = 0;
};

}  // namespace kt::cpu
