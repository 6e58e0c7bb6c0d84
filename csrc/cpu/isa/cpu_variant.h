// [NOTE] CPU variants: the instruction-set levels kernels are compiled for, detected at
// run time from CPUID and the OS's XCR0 state (and, for AMX, the Linux permission to
// use tile state). The best supported variant (the last in enum order) is active unless
// KT_OPS_CPU_VARIANT or set_cpu_variant() asks for another; asking for an unsupported
// one is an error. avx_vnni (AVX2 + the VEX-encoded 256-bit vpdpbusd of Alder Lake and
// later Intel Cores, Zen 5) is a side branch: the AVX-512 variants do not require it, so
// an AVX-512 CPU without AVX-VNNI (Zen 4, Ice Lake) still runs them. avx512_vnni is
// AVX-512 with the 512-bit vpdpbusd but no AVX512_BF16 (Cascade Lake, Ice Lake Xeons):
// its integer formats multiply with vpdpbusd, its float formats run the avx512 kernels.
#pragma once

#include <string>
#include <vector>

namespace kt::cpu {

// Ordered by preference, oldest first. Each AVX-512 level implies avx2 and the AVX-512
// levels before it; avx_vnni implies avx2 only.
enum class CpuVariant { kAvx2 = 0, kAvxVnni = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4, kAmx = 5 };
constexpr int kNumCpuVariants = 6;

const char* cpu_variant_name(CpuVariant variant);
// Throws std::invalid_argument for an unknown name.
CpuVariant parse_cpu_variant(const std::string& name);

// Empty when supported, otherwise what is missing ("avx512_bf16 (CPUID)").
std::string missing_features(CpuVariant variant);
std::vector<CpuVariant> supported_cpu_variants();

// The active variant. Throws std::runtime_error when none is supported (pre-AVX2 CPU).
CpuVariant active_cpu_variant();
// Throws std::invalid_argument (unknown) or std::runtime_error (unsupported, with the
// missing features named).
void set_active_cpu_variant(CpuVariant variant);

}  // namespace kt::cpu
