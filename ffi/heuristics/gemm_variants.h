// Which compiled schedule variant each grouped GEMM runs: the measured defaults and the
// environment overrides for benchmarking, read once per process. What each variant number is
// (tile, cluster, kernel schedule): heuristics/sm90_gemm_schedules.cuh.
//   MEGAMOE_GROUPED_GEMM_VARIANT  bf16 GEMMs: "1" (every kind) or "fprop:0,dgrad:2,wgrad:1"
//   MEGAMOE_FP8_GEMM_VARIANT      FP8 rows x weights (fprop, dgrad): one digit
//   MEGAMOE_FP8_WGRAD_VARIANT     FP8 K-grouped weight gradient: one digit
// Unset or empty: the default; a value that names no variant refuses the GEMM's call by name
// (until session 36 it was ignored, which let a mistyped A/B time the default twice).
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "ffi/gemm/grouped_gemm.h"
#include "ffi/heuristics/env_override.h"

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

// MEGAMOE_GROUPED_GEMM_VARIANT parsed: per kind (GemmKind order) the variant, -1 for the
// default; or an error text, with every kind at its default.
struct Bf16VariantOverride {
  int chosen[3] = {-1, -1, -1};
  std::string error;
};

inline Bf16VariantOverride ParseBf16GemmVariant(const char* env) {
  Bf16VariantOverride o;
  if (env == nullptr || env[0] == '\0') return o;
  const auto digit = [](char c) { return c >= '0' && c < '0' + kBf16GemmVariants; };
  if (digit(env[0]) && env[1] == '\0') {
    o.chosen[0] = o.chosen[1] = o.chosen[2] = env[0] - '0';
    return o;
  }
  const char* names[3] = {"fprop:", "dgrad:", "wgrad:"};
  for (const char* at = env;;) {
    int kind = 0;
    while (kind < 3 && std::strncmp(at, names[kind], 6) != 0) ++kind;
    if (kind == 3 || !digit(at[6]) || o.chosen[kind] >= 0 || (at[7] != ',' && at[7] != '\0')) {
      Bf16VariantOverride bad;
      bad.error = std::string("MEGAMOE_GROUPED_GEMM_VARIANT must be one digit below ") +
                  std::to_string(kBf16GemmVariants) +
                  " or kind:digit items joined by commas, each of fprop, dgrad, wgrad at most "
                  "once, got '" + env + "'";
      return bad;
    }
    o.chosen[kind] = at[6] - '0';
    if (at[7] == '\0') return o;
    at += 8;
  }
}

// The bf16 GEMM's variant (read once per process). Returns the override's error text, if any,
// with *variant at the default (so that workspace sizes stay those of a compiled variant).
inline std::string Bf16GemmVariant(grouped::GemmKind kind, int num_groups, int* variant) {
  static const Bf16VariantOverride o =
      ParseBf16GemmVariant(std::getenv("MEGAMOE_GROUPED_GEMM_VARIANT"));
  const int v = o.chosen[static_cast<int>(kind)];
  *variant = v >= 0 ? v : DefaultBf16GemmVariant(kind, num_groups);
  return o.error;
}

// An FP8 GEMM's variant: environment variable `name`, one digit below `count`; unset or empty:
// 0, the measured best of the FP8 GEMMs (benchmarks/RESULTS.md); anything else: an error text,
// with the variant 0.
struct Fp8Variant {
  int variant = 0;
  std::string error;
};

inline Fp8Variant Fp8VariantFromEnv(const char* name, int count) {
  const std::string choices = std::string("0123456789").substr(0, count);
  char choice;
  Fp8Variant r;
  r.error = OneCharOverride(name, choices.c_str(), &choice);
  if (r.error.empty() && choice != '\0') r.variant = choice - '0';
  return r;
}

// Read once per process; each returns the override's error text, if any.
inline std::string Fp8GemmVariant(int* variant) {
  static const Fp8Variant v = Fp8VariantFromEnv("MEGAMOE_FP8_GEMM_VARIANT", kFp8GemmVariants);
  *variant = v.variant;
  return v.error;
}

inline std::string Fp8WgradVariant(int* variant) {
  static const Fp8Variant v = Fp8VariantFromEnv("MEGAMOE_FP8_WGRAD_VARIANT", kFp8WgradVariants);
  *variant = v.variant;
  return v.error;
}

}  // namespace megamoe::heuristics
