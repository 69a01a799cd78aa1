// Which compiled schedule variant each grouped GEMM runs: the measured defaults and the
// environment overrides for benchmarking, read once per process. What each variant number is
// (tile, cluster, kernel schedule): heuristics/sm90_gemm_schedules.cuh.
//   MEGAMOE_GROUPED_GEMM_VARIANT  bf16 GEMMs: "1" (every kind) or "fprop:0,dgrad:2,wgrad:1"
//   MEGAMOE_FP8_GEMM_VARIANT      FP8 rows x weights (fprop, dgrad): one digit
//   MEGAMOE_FP8_WGRAD_VARIANT     FP8 K-grouped weight gradient: one digit
// A value that names no variant is ignored (the default runs).
#pragma once

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "ffi/gemm/grouped_gemm.h"

namespace megamoe::heuristics {

inline constexpr int kBf16GemmVariants = 3;
inline constexpr int kFp8GemmVariants = 3;
inline constexpr int kFp8WgradVariants = 2;

// bf16 defaults from benchmarks/RESULTS.md (H200, 131,072 rows): cooperative 128x256 is fastest
// for fprop and dgrad at every measured shape; for wgrad ping-pong wins with many small groups
// (128 experts), cooperative with few large ones (16).
inline int DefaultBf16GemmVariant(grouped::GemmKind kind, int num_groups) {
  if (kind == grouped::GemmKind::kWgrad) return num_groups >= 64 ? 2 : 0;
  return 0;
}

inline int Bf16GemmVariant(grouped::GemmKind kind, int num_groups) {
  static std::once_flag once;
  static int chosen[3] = {-1, -1, -1};  // per kind; -1: the default
  std::call_once(once, [] {
    const char* env = std::getenv("MEGAMOE_GROUPED_GEMM_VARIANT");
    if (env == nullptr || *env == '\0') return;
    if (env[1] == '\0' && env[0] >= '0' && env[0] < '0' + kBf16GemmVariants) {
      chosen[0] = chosen[1] = chosen[2] = env[0] - '0';
      return;
    }
    const char* names[3] = {"fprop:", "dgrad:", "wgrad:"};
    for (int k = 0; k < 3; ++k) {
      const char* at = std::strstr(env, names[k]);
      if (at != nullptr) {
        const char c = at[std::strlen(names[k])];
        if (c >= '0' && c < '0' + kBf16GemmVariants) chosen[k] = c - '0';
      }
    }
  });
  const int v = chosen[static_cast<int>(kind)];
  return v >= 0 ? v : DefaultBf16GemmVariant(kind, num_groups);
}

// The variant named by environment variable `name` (one digit below `count`), else 0, the
// measured best of the FP8 GEMMs (benchmarks/RESULTS.md).
inline int Fp8VariantFromEnv(const char* name, int count) {
  const char* env = std::getenv(name);
  if (env != nullptr && env[0] >= '0' && env[0] < '0' + count && env[1] == '\0') {
    return env[0] - '0';
  }
  return 0;
}

inline int Fp8GemmVariant() {
  static const int chosen = Fp8VariantFromEnv("MEGAMOE_FP8_GEMM_VARIANT", kFp8GemmVariants);
  return chosen;
}

inline int Fp8WgradVariant() {
  static const int chosen = Fp8VariantFromEnv("MEGAMOE_FP8_WGRAD_VARIANT", kFp8WgradVariants);
  return chosen;
}

}  // namespace megamoe::heuristics
