// [NOTE] What the CPU's model, not its instruction set, changes in the kernels (the
// variants, cpu_variant.h, are chosen by instruction set alone). Read once from CPUID:
// vendor, family and model.
#pragma once

namespace kt::cpu {

// Whether PREFETCHT1 (prefetch.h's prefetch_l2) fills L1 as PREFETCHT0 does: AMD before
// Zen 4, i.e. families 17h (Zen, Zen 2) and 18h (Hygon's Zen) and family 19h's Zen 3
// models (00h-0Fh, 20h-5Fh, as Linux's arch/x86/kernel/cpu/amd.c tells them from Zen 4's).
// AMD documents T1/T2 into L2 as new with Zen 4 (quoted by Wang et al., "The Hitchhiker's
// Guide to Programming and Optimizing CXL-Based Heterogeneous Systems", arXiv 2411.02814).
// False for every other CPU (Intel places T1 in L2).
bool prefetch_l2_fills_l1();

}  // namespace kt::cpu
