// The error of the kernel launches just enqueued, as the kernels' plain C++ interfaces report
// it: "" when there is none, else what failed.
#pragma once

#include <string>

#include <cuda_runtime.h>

namespace megamoe {

inline std::string LastLaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(err);
}

}  // namespace megamoe
