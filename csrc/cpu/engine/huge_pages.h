// Transparent huge pages for large, long-lived buffers (packed experts).
#pragma once

#include <cstddef>

namespace kt::cpu {

// Asks the kernel (madvise MADV_HUGEPAGE) to back the 2 MiB-aligned pages inside
// [data, data + bytes) with huge pages when they are first touched. A decode call
// touches every weight page once; with 4 KiB pages each of them is a page walk that
// misses the caches (measured ~300 us per 1-token S1 layer). Best effort: does nothing
// where unsupported.
void advise_huge_pages(void* data, size_t bytes);

}  // namespace kt::cpu
