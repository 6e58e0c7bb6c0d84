#include "node_memory.h"

#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "engine.h"
#include "huge_pages.h"

namespace kt::cpu {
namespace {

constexpr size_t kCopyChunk = size_t{2} << 20;  // one huge page per job
constexpr int kMaskWords = 16;                  // node ids < 1024

// mbind(MPOL_PREFERRED, {node}); false where the kernel refuses (no NUMA, seccomp, a node
// id past the mask).
bool prefer_node(void* data, size_t bytes, int node) {
  if (node < 0 || node >= kMaskWords * 64) return false;
  unsigned long mask[kMaskWords] = {};
  mask[node / 64] |= 1UL << (node % 64);
  // maxnode counts one past the mask's bits (the kernel reads maxnode - 1 of them).
  return syscall(SYS_mbind, data, bytes, MPOL_PREFERRED, mask, kMaskWords * 64 + 1, 0) == 0;
}

}  // namespace

NodeMemory copy_to_node(const uint8_t* src, size_t bytes, int node) {
  Engine& engine = Engine::instance();
  engine.require_node(node);
  NodeMemory memory;
  memory.bytes = bytes;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  memory.mapped = std::max(page, (bytes + page - 1) / page * page);
  void* data = mmap(nullptr, memory.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  memory.data = static_cast<uint8_t*>(data);
  advise_huge_pages(data, memory.mapped);
  memory.bound = !engine.topology().simulated && prefer_node(data, memory.mapped, node);
  const int64_t chunks = static_cast<int64_t>((bytes + kCopyChunk - 1) / kCopyChunk);
  try {
    engine.run_on_nodes({node}, [&](int64_t) {
      engine.parallel_for(chunks, [&](int64_t chunk) {
        const size_t begin = static_cast<size_t>(chunk) * kCopyChunk;
        std::memcpy(memory.data + begin, src + begin, std::min(kCopyChunk, bytes - begin));
      });
    });
  } catch (...) {
    free_node_memory(memory);
    throw;
  }
  return memory;
}

void free_node_memory(const NodeMemory& memory) {
  if (memory.data != nullptr) munmap(memory.data, memory.mapped);
}

}  // namespace kt::cpu
