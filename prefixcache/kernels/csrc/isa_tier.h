// The kernel tier the Python side chose (prefixcache.kernels.cpu_features.kernel_tier: what the CPU reports,
// capped by PREFIXCACHE_KERNELS), passed into each extension at load and again when the cap changes
// (build.tell_tier -> set_kernel_tier, bindings*.cpp).
// Every run-time choice between forms in C++ asks tier_allows() as well as the CPU (__builtin_cpu_supports,
// cpuid): without it a C++ dispatch would take a form the cap took away (PREFIXCACHE_KERNELS=avx512 must run
// generated rows' attention in its float32 form, as a CPU without AVX512-BF16 does).
#pragma once

// cpu_features.TIERS in order; the value is the tier's index there
enum KernelTier : int { kTierReference = 0, kTierAvx2 = 1, kTierAvx512 = 2, kTierAvx512Bf16 = 3, kTierAmx = 4 };

// Defined once per extension (its bindings file); kTierAmx until set_kernel_tier runs, which adds no feature
// the CPU lacks: the CPU is always asked too.
extern int prefixcache_kernel_tier;

inline bool tier_allows(KernelTier tier) { return prefixcache_kernel_tier >= tier; }
