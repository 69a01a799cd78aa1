// A CUDA driver entry point looked up through the runtime, so that nothing links against libcuda
// (the extension loads where only the runtime is on the library path).
#pragma once

#include <cuda_runtime.h>

namespace megamoe {

// The driver's `name` (its CUDA 12.0 ABI) as Fn, or nullptr where this driver lacks it.
template <class Fn>
Fn DriverEntryPoint(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(p);
}

}  // namespace megamoe
