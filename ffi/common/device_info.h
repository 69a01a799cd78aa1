// Facts about the current CUDA device, queried once per device ordinal (host calls only, no
// stream work: safe inside a handler that XLA may capture into a CUDA graph).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <type_traits>

namespace megamoe {

inline constexpr int kMaxDevices = 64;

// compute(device) for the current device, computed once per device ordinal; Tag names the
// quantity (one cache per Tag).
template <class Tag, class Compute>
int OncePerCurrentDevice(Compute compute) {
  static std::once_flag once[kMaxDevices];
  static int value[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  dev %= kMaxDevices;
  std::call_once(once[dev], [&] { value[dev] = compute(dev); });
  return value[dev];
}

// A device attribute of the current device, queried once per device ordinal.
template <cudaDeviceAttr kAttr>
int CurrentDeviceAttribute() {
  return OncePerCurrentDevice<std::integral_constant<cudaDeviceAttr, kAttr>>([](int dev) {
    int value = 0;
    cudaDeviceGetAttribute(&value, kAttr, dev);
    return value;
  });
}

// Multiprocessor count of the current device (132 on an H200 SXM).
inline int CurrentDeviceSmCount() {
  return CurrentDeviceAttribute<cudaDevAttrMultiProcessorCount>();
}

// Compute capability major of the current device (9 on an H200).
inline int CurrentDeviceComputeMajor() {
  return CurrentDeviceAttribute<cudaDevAttrComputeCapabilityMajor>();
}

// The largest multiprocessor count among the visible devices, 0 when there are none (host
// only; sizes a scratch buffer while tracing, before XLA picks the device).
inline int MaxVisibleSmCount() {
  static std::once_flag once;
  static int value = 0;
  std::call_once(once, [] {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: leave no error behind
      return;
    }
    for (int d = 0; d < devices; ++d) {
      int sm = 0;
      cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, d);
      value = value > sm ? value : sm;
    }
  });
  return value;
}

}  // namespace megamoe
