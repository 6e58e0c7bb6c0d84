#include "cpu_variant.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>

namespace kt::cpu {
namespace {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false, avx_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;  // XCR0 state enabled by the OS
  bool amx_permitted = false;                              // arch_prctl granted tile data
};

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux: a process must request permission before it may use AMX tile data.
bool request_amx_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(1, 0, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1;
  f.fma = (ecx >> 12) & 1;
  f.f16c = (ecx >> 29) & 1;
  if (osxsave) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;
    f.os_avx512 = (xcr0 & 0xe6) == 0xe6;
    f.os_amx = (xcr0 & 0x60000) == 0x60000;
  }
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2 = (ebx >> 5) & 1;
  f.bmi2 = (ebx >> 8) & 1;  // every variant is compiled with it (shlx, sarx)
  f.avx512f = (ebx >> 16) & 1;
  f.avx512dq = (ebx >> 17) & 1;
  f.avx512bw = (ebx >> 30) & 1;
  f.avx512vl = (ebx >> 31) & 1;
  f.avx512_vnni = (ecx >> 11) & 1;
  f.amx_bf16 = (edx >> 22) & 1;
  f.amx_tile = (edx >> 24) & 1;
  f.amx_int8 = (edx >> 25) & 1;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    f.avx_vnni = (eax >> 4) & 1;
    f.avx512_bf16 = (eax >> 5) & 1;
  }
  if (f.amx_tile && f.os_amx) f.amx_permitted = request_amx_permission();
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

void require(std::string& missing, bool present, const char* what) {
  if (present) return;
  if (!missing.empty()) missing += ", ";
  missing += what;
}

CpuVariant best_supported() {
  for (int v = kNumCpuVariants - 1; v >= 0; --v)
    if (missing_features(static_cast<CpuVariant>(v)).empty()) return static_cast<CpuVariant>(v);
  throw std::runtime_error(
      "kt_ops needs at least AVX2+FMA+F16C; this CPU/OS lacks: " +
      missing_features(CpuVariant::kAvx2));
}

std::atomic<int>& active_slot() {
  static std::atomic<int> slot{static_cast<int>(best_supported())};
  return slot;
}

}  // namespace

const char* cpu_variant_name(CpuVariant variant) {
  switch (variant) {
    case CpuVariant::kAvx2: return "avx2";
    case CpuVariant::kAvxVnni: return "avx_vnni";
    case CpuVariant::kAvx512: return "avx512";
    case CpuVariant::kAvx512Vnni: return "avx512_vnni";
    case CpuVariant::kAvx512Bf16: return "avx512_bf16";
    case CpuVariant::kAmx: return "amx";
  }
  return "unknown";
}

CpuVariant parse_cpu_variant(const std::string& name) {
  for (int v = 0; v < kNumCpuVariants; ++v)
    if (name == cpu_variant_name(static_cast<CpuVariant>(v))) return static_cast<CpuVariant>(v);
  throw std::invalid_argument("unknown CPU variant '" + name +
                              "'; expected one of: avx2, avx_vnni, avx512, avx512_vnni, avx512_bf16, amx");
}

std::string missing_features(CpuVariant variant) {
  const CpuFeatures& f = features();
  std::string missing;
  const int level = static_cast<int>(variant);
  require(missing, f.avx2 && f.fma && f.f16c && f.bmi2, "avx2+fma+f16c+bmi2 (CPUID)");
  require(missing, f.os_avx, "AVX state (XCR0)");
  if (variant == CpuVariant::kAvxVnni) require(missing, f.avx_vnni, "avx_vnni (CPUID)");
  if (level >= static_cast<int>(CpuVariant::kAvx512)) {
    require(missing, f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq,
            "avx512f/bw/vl/dq (CPUID)");
    require(missing, f.os_avx512, "AVX-512 state (XCR0)");
  }
  if (level >= static_cast<int>(CpuVariant::kAvx512Vnni)) require(missing, f.avx512_vnni, "avx512_vnni (CPUID)");
  if (level >= static_cast<int>(CpuVariant::kAvx512Bf16)) require(missing, f.avx512_bf16, "avx512_bf16 (CPUID)");
  if (level >= static_cast<int>(CpuVariant::kAmx)) {
    require(missing, f.amx_tile && f.amx_bf16 && f.amx_int8, "amx_tile/bf16/int8 (CPUID)");
    require(missing, f.os_amx, "AMX tile state (XCR0)");
    require(missing, f.amx_permitted || !(f.amx_tile && f.os_amx),
            "AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM refused)");
  }
  return missing;
}

std::vector<CpuVariant> supported_cpu_variants() {
  std::vector<CpuVariant> supported;
  for (int v = 0; v < kNumCpuVariants; ++v)
    if (missing_features(static_cast<CpuVariant>(v)).empty())
      supported.push_back(static_cast<CpuVariant>(v));
  return supported;
}

CpuVariant active_cpu_variant() {
  return static_cast<CpuVariant>(active_slot().load(std::memory_order_acquire));
}

void set_active_cpu_variant(CpuVariant variant) {
  const std::string missing = missing_features(variant);
  if (!missing.empty())
    throw std::runtime_error(std::string("CPU variant '") + cpu_variant_name(variant) +
                             "' is not supported here; missing: " + missing);
  active_slot().store(static_cast<int>(variant), std::memory_order_release);
}

}  // namespace kt::cpu
