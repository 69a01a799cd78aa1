// The parsers of the environment overrides here: one character ("0" / "1", "m" / "n") or a
// bounded integer, so that each refuses a mistyped value by name instead of quietly running its
// default (session 35: an override that did nothing voided a benchmark). The Python side's are
// jax_megamoe/env_overrides.py.
#pragma once

#include <cstdlib>
#include <string>

namespace megamoe::heuristics {

// Reads variable `name`. Unset or empty: "" and *choice = '\0'. One of `choices`: "" and
// *choice = it. Anything else: an error text naming the variable, the choices and the value.
inline std::string OneCharOverride(const char* name, const char* choices, char* choice) {
  *choice = '\0';
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return "";
  for (const char* c = choices; *c != '\0'; ++c) {
    if (env[0] == *c && env[1] == '\0') {
      *choice = *c;
      return "";
    }
  }
  std::string allowed;
  for (const char* c = choices; *c != '\0'; ++c) {
    if (!allowed.empty()) allowed += c[1] == '\0' ? " or " : ", ";
    allowed += *c;
  }
  return std::string(name) + " must be " + allowed + ", got '" + env + "'";
}

// Reads variable `name` as a decimal integer in [lo, hi] (digits only: no sign, no spaces).
// Unset or empty: "" and *value untouched (the caller's default). In range: "" and *value = it.
// Anything else: an error text naming the variable, `what` (e.g. "an integer percent"), the
// range and the value.
inline std::string IntOverride(const char* name, int lo, int hi, const char* what, int* value) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return "";
  long v = 0;
  bool digits_only = true;
  int digits = 0;
  for (const char* c = env; *c != '\0'; ++c, ++digits) {
    if (*c < '0' || *c > '9' || digits == 9) {  // 9 digits fit an int
      digits_only = false;
      break;
    }
    v = v * 10 + (*c - '0');
  }
  if (!digits_only || v < lo || v > hi) {
    return std::string(name) + " must be " + what + " in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "], got \"" + env + "\"";
  }
  *value = static_cast<int>(v);
  return "";
}

}  // namespace megamoe::heuristics
