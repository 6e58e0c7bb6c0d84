#include "scratch.h"

#include <cstdlib>
#include <memory>
#include <new>

namespace kt::cpu {

uint8_t* thread_scratch(size_t bytes) {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, Free> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    const size_t rounded = (bytes + (bytes >> 2) + 4095) / 4096 * 4096;  // 25% headroom
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
    if (!buffer) {
      capacity = 0;
      throw std::bad_alloc();
    }
    capacity = rounded;
  }
  return buffer.get();
}

}  // namespace kt::cpu
