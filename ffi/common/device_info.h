// Facts about the current CUDA device, queried once per device ordinal (host calls only, no
// stream work: safe inside a handler that XLA may capture into a CUDA graph).
#pragma once

#include <cuda_runtime.h>

#include <mutex>

namespace megamoe {

inline constexpr int kMaxDevices = 64;

// Multiprocessor count of the current device (132 on an H200 SXM).
inline int CurrentDeviceSmCount() {
  static std::once_flag once[kMaxDevices];
  static int value[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  dev %= kMaxDevices;
  std::call_once(once[dev], [&] {
    value[dev] = 0;
    cudaDeviceGetAttribute(&value[dev], cudaDevAttrMultiProcessorCount, dev);
  });
  return value[dev];
}

}  // namespace megamoe
