#include "cpu_model.h"

#include <cpuid.h>

#include <cstring>

namespace kt::cpu {
namespace {

bool detect_prefetch_l2_fills_l1() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  const bool amd = std::strcmp(vendor, "AuthenticAMD") == 0, hygon = std::strcmp(vendor, "HygonGenuine") == 0;
  if (!(amd || hygon) || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned base_family = (eax >> 8) & 0xf;
  const unsigned family = base_family == 0xf ? base_family + ((eax >> 20) & 0xff) : base_family;
  const unsigned model = base_family == 0xf ? (((eax >> 16) & 0xf) << 4) | ((eax >> 4) & 0xf) : (eax >> 4) & 0xf;
  if (family == 0x17 || family == 0x18) return true;
  if (family == 0x19) return model <= 0x0f || (model >= 0x20 && model <= 0x5f);
  return false;
}

}  // namespace

bool prefetch_l2_fills_l1() {
  static const bool fills = detect_prefetch_l2_fills_l1();
  return fills;
}

}  // namespace kt::cpu
