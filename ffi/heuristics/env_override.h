// The environment overrides of the heuristics here that take one character ("0" / "1",
// "m" / "n"): one parser, so that each refuses a mistyped value by name instead of quietly
// running its default (session 35: an override that did nothing voided a benchmark).
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

}  // namespace megamoe::heuristics
