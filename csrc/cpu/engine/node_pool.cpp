#include "node_pool.h"

#include <vector>

namespace kt::cpu {

NodePool::NodePool(const NodePlan& plan, int64_t spin_ns) : plan_(plan), spin_ns_(spin_ns) {
  std::vector<int> helpers = plan.cpus;
  if (!plan.has_caller() && !helpers.empty()) {
    leader_ = std::make_unique<WorkerPool>(std::vector<int>{helpers.front()}, spin_ns);
    helpers.erase(helpers.begin());
  }
  if (!helpers.empty()) helpers_ = std::make_unique<WorkerPool>(helpers, spin_ns);
}

uint32_t NodePool::num_own_threads() const { return static_cast<uint32_t>(plan_.cpus.size()); }

void NodePool::start(Job* job) {
  if (leader_) leader_->start(job);
  if (helpers_) helpers_->start(job);
}

void NodePool::parallel_for(int64_t n, FunctionRef<void(int64_t)> fn) {
  if (!helpers_) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  job_.reset(n, &fn, static_cast<uint32_t>(helpers_->num_helpers()));
  helpers_->start(&job_);
  job_.work();
  job_.wait_for_helpers(spin_ns_);
}

void NodePool::start_leader(const FunctionRef<void(int64_t)>* fn) {
  leader_job_.reset(1, fn, 1);
  leader_->start(&leader_job_);
}

void NodePool::wait_for_leader() { leader_job_.wait_for_helpers(spin_ns_); }

}  // namespace kt::cpu
