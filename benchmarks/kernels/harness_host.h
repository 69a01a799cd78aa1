// Host helpers shared by the standalone harnesses of the fused MoE GEMM core
// (fused_core_bench.cu, fused_core_fp8_bench.cu): CUDA error checks that name the failing call
// and exit, device buffers from host vectors and back, digests of outputs (to compare two builds
// bit for bit), and the tile walk they schedule with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "ffi/gemm/sm90_moe_tile_engine.cuh"
#include "ffi/scheduler/expert_tile_walk.cuh"

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__, #x);                                                             \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

// A fault of the launch just made, named (a sticky error would otherwise surface later).
static void SyncOrDie(const char* what) {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    fprintf(stderr, "CUDA error after %s: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}

// An error string of the project's launch helpers ("" = none).
static void CheckStr(const std::string& s) {
  if (!s.empty()) {
    fprintf(stderr, "error: %s\n", s.c_str());
    exit(2);
  }
}

// FNV-1a over n bytes.
static uint64_t Fnv1a(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  return h;
}

// FNV-1a of n bytes of device memory (0 for a null pointer).
static uint64_t DeviceDigest(const void* d, size_t n) {
  if (d == nullptr) return 0;
  std::vector<uint8_t> h(n);
  CK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
  return Fnv1a(h.data(), n);
}

template <class T>
static T* DevAlloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

template <class T>
static T* DevCopy(const std::vector<T>& v) {
  T* p = DevAlloc<T>(v.size());
  if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <class T>
static std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> v(n);
  if (n > 0) CK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

constexpr int kMaxExperts = 256;
using Walk = megamoe::fused::ExpertTileWalk<128, kMaxExperts>;
using Params = megamoe::fused::sm90::EngineParams<megamoe::fused::sm90::IndexedRowDest>;
