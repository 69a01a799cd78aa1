// Integer rounding shared by the layouts of workspaces and scratch buffers.
#pragma once

#include <cstdint>

#include "ffi/common/host_device.h"

namespace megamoe {

// v rounded up to a multiple of a (a > 0).
MEGAMOE_HOST_DEVICE inline constexpr int64_t AlignUp(int64_t v, int64_t a) {
  return (v + a - 1) / a * a;
}

}  // namespace megamoe
