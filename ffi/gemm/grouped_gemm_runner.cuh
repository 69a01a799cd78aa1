// The one runner of the CUTLASS 3.x ptr-array grouped GEMMs (sm90 bf16 and FP8, sm100 MXFP8).
// Each group's problem shape, pointers and strides (and scale-factor layouts) are written on the
// device by a small prepare kernel from the group offsets, so the host never learns the group
// sizes (no sync; CUDA-graph friendly). Templated over a traits class G:
//   Kernel, Gemm      the CUTLASS kernel and device adapter (gemm/sm90_collective.cuh for sm90)
//   kName             what error messages call the GEMM
//   kBlockScaled      whether the mainloop takes scale factors; then also ElementSF, LayoutSFA,
//                     LayoutSFB and ScaleConfig (a group's scale layouts from its m, n, k)
// Workspace: the per-group argument arrays (GroupArgsLayout), then CUTLASS's own workspace.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/kernel_hardware_info.h"
#include "ffi/common/align.h"
#include "ffi/common/device_info.h"

namespace megamoe::gemm {

// A rank-3 (outer, inner, batch) CuTe stride with unit stride on its static mode and `ld` on
// its dynamic one; batch stride 0 (one batch).
template <class Stride>
CUTE_HOST_DEVICE Stride LeadingStride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<2>(s))>>::value) {
    cute::get<2>(s) = 0;
  }
  return s;
}

// The types of one group's arguments, as the kernel reads them.
template <class G>
struct GroupTypes {
  using Shape3 = typename G::Kernel::ProblemShape::UnderlyingProblemShape;
  using ElementA = typename G::Kernel::ElementA;
  using ElementB = typename G::Kernel::ElementB;
  using ElementD = typename G::Kernel::ElementD;
  using StrideA = typename G::Kernel::InternalStrideA;
  using StrideB = typename G::Kernel::InternalStrideB;
  using StrideD = typename G::Kernel::InternalStrideD;
};

// Byte offsets of the per-group argument arrays in the workspace (each 256-byte aligned).
template <class G>
struct GroupArgsLayout {
  using T = GroupTypes<G>;
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d;
  size_t ptr_sfa = 0, ptr_sfb = 0, layout_sfa = 0, layout_sfb = 0;  // block-scaled only
  size_t cutlass_ws;  // CUTLASS's workspace starts here

  explicit GroupArgsLayout(int e) {
    size_t o = 0;
    auto take = [&o, e](size_t bytes_per_group) {
      const size_t at = o;
      o += size_t(AlignUp(int64_t(bytes_per_group) * e, 256));
      return at;
    };
    shapes = take(sizeof(typename T::Shape3));
    ptr_a = take(sizeof(void*));
    ptr_b = take(sizeof(void*));
    ptr_d = take(sizeof(void*));
    stride_a = take(sizeof(typename T::StrideA));
    stride_b = take(sizeof(typename T::StrideB));
    stride_d = take(sizeof(typename T::StrideD));
    if constexpr (G::kBlockScaled) {
      ptr_sfa = take(sizeof(void*));
      ptr_sfb = take(sizeof(void*));
      layout_sfa = take(sizeof(typename G::LayoutSFA));
      layout_sfb = take(sizeof(typename G::LayoutSFB));
    }
    cutlass_ws = o;
  }
};

// The scale-factor arrays of a block-scaled GEMM (none otherwise).
template <class G, bool = G::kBlockScaled>
struct GroupScaleArrays {
  const typename G::ElementSF** ptr_sfa;
  const typename G::ElementSF** ptr_sfb;
  typename G::LayoutSFA* layout_sfa;
  typename G::LayoutSFB* layout_sfb;
  GroupScaleArrays(const GroupArgsLayout<G>& l, uint8_t* ws)
      : ptr_sfa(reinterpret_cast<const typename G::ElementSF**>(ws + l.ptr_sfa)),
        ptr_sfb(reinterpret_cast<const typename G::ElementSF**>(ws + l.ptr_sfb)),
        layout_sfa(reinterpret_cast<typename G::LayoutSFA*>(ws + l.layout_sfa)),
        layout_sfb(reinterpret_cast<typename G::LayoutSFB*>(ws + l.layout_sfb)) {}

  // Group g's scale factors and their layouts for the problem (m, n, k).
  __device__ void SetScales(int g, int m, int n, int k, const typename G::ElementSF* sfa,
                            const typename G::ElementSF* sfb) const {
    ptr_sfa[g] = sfa;
    ptr_sfb[g] = sfb;
    layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  }
};
template <class G>
struct GroupScaleArrays<G, false> {
  GroupScaleArrays(const GroupArgsLayout<G>&, uint8_t*) {}
};

// The per-group argument arrays in the workspace: what the prepare kernels write (Set, and
// SetScales where block-scaled) and the CUTLASS arguments point to.
template <class G>
struct GroupArgs : GroupScaleArrays<G> {
  using T = GroupTypes<G>;
  typename T::Shape3* shapes;
  const typename T::ElementA** ptr_a;
  const typename T::ElementB** ptr_b;
  typename T::ElementD** ptr_d;
  typename T::StrideA* stride_a;
  typename T::StrideB* stride_b;
  typename T::StrideD* stride_d;

  GroupArgs(const GroupArgsLayout<G>& l, uint8_t* ws)
      : GroupScaleArrays<G>(l, ws),
        shapes(reinterpret_cast<typename T::Shape3*>(ws + l.shapes)),
        ptr_a(reinterpret_cast<const typename T::ElementA**>(ws + l.ptr_a)),
        ptr_b(reinterpret_cast<const typename T::ElementB**>(ws + l.ptr_b)),
        ptr_d(reinterpret_cast<typename T::ElementD**>(ws + l.ptr_d)),
        stride_a(reinterpret_cast<typename T::StrideA*>(ws + l.stride_a)),
        stride_b(reinterpret_cast<typename T::StrideB*>(ws + l.stride_b)),
        stride_d(reinterpret_cast<typename T::StrideD*>(ws + l.stride_d)) {}

  // Group g: D [m, n] (row stride ldd) = A [m, k] (leading stride lda) times B [k, n] (leading
  // stride ldb), in the operand layouts of G.
  __device__ void Set(int g, int m, int n, int k, const void* a, int64_t lda, const void* b,
                      int64_t ldb, void* d, int64_t ldd) const {
    shapes[g] = typename T::Shape3(m, n, k);
    ptr_a[g] = static_cast<const typename T::ElementA*>(a);
    ptr_b[g] = static_cast<const typename T::ElementB*>(b);
    ptr_d[g] = static_cast<typename T::ElementD*>(d);
    stride_a[g] = LeadingStride<typename T::StrideA>(lda);
    stride_b[g] = LeadingStride<typename T::StrideB>(ldb);
    stride_d[g] = LeadingStride<typename T::StrideD>(ldd);
  }
};

// CUTLASS's arguments for `num_groups` groups whose arrays are at `a`.
template <class G>
typename G::Gemm::Arguments MakeArguments(const GroupArgs<G>& a, int num_groups, int sm_count,
                                          int max_active_clusters) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  hw.max_active_clusters = max_active_clusters;
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  typename G::Kernel::MainloopArguments mainloop;
  if constexpr (G::kBlockScaled) {
    mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b,
                a.ptr_sfa, a.layout_sfa, a.ptr_sfb, a.layout_sfb};
  } else {
    mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
  }
  args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {num_groups, a.shapes, nullptr},
                                     mainloop,
                                     {fusion, nullptr, a.stride_d, a.ptr_d, a.stride_d},
                                     hw};
  return args;
}

// Clusters of G's kernel that fit the current device at once; queried once per device (host
// only, not a stream operation).
template <class G>
int MaxActiveClusters() {
  static std::once_flag once[kMaxDevices];
  static int value[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  dev %= kMaxDevices;
  std::call_once(once[dev], [&] {
    cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                         int(sizeof(typename G::Kernel::SharedStorage)));
    value[dev] = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename G::Kernel>();
  });
  return value[dev];
}

// Device bytes of workspace G needs for `num_groups` groups on `sm_count` multiprocessors.
template <class G>
size_t WorkspaceBytes(int num_groups, int sm_count) {
  const GroupArgsLayout<G> l(num_groups);
  return l.cutlass_ws + G::Gemm::get_workspace_size(MakeArguments<G>(
                            GroupArgs<G>(l, nullptr), num_groups, sm_count, 0));
}

// can_implement, initialize and run of one CUTLASS GemmUniversalAdapter on `stream`; "" or the
// failing stage, prefixed with `what`.
template <class Gemm>
std::string RunCutlass(const typename Gemm::Arguments& args, void* cutlass_workspace,
                       cudaStream_t stream, const char* what) {
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    return std::string(what) + " can_implement: " + cutlassGetStatusString(status);
  }
  status = gemm.initialize(args, cutlass_workspace, stream);
  if (status != cutlass::Status::kSuccess) {
    return std::string(what) + " initialize: " + cutlassGetStatusString(status);
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    return std::string(what) + " run: " + cutlassGetStatusString(status);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string(what) + " launch: " + cudaGetErrorString(err);
  return "";
}

// Enqueues `prepare(GroupArgs<G>, stream)` (the launch of a kernel that writes every group's
// arguments), then G's kernel. "" or what failed.
template <class G, class Prepare>
std::string Run(int num_groups, Prepare prepare, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream) {
  const GroupArgsLayout<G> l(num_groups);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  const GroupArgs<G> group_args(l, ws);
  const typename G::Gemm::Arguments args =
      MakeArguments<G>(group_args, num_groups, sm_count, MaxActiveClusters<G>());
  const size_t need = l.cutlass_ws + G::Gemm::get_workspace_size(args);
  if (need > workspace_bytes) {
    return std::string(G::kName) + " workspace too small: need " + std::to_string(need) +
           " bytes, have " + std::to_string(workspace_bytes);
  }
  prepare(group_args, stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return std::string(G::kName) + " prepare launch: " + cudaGetErrorString(err);
  }
  return RunCutlass<typename G::Gemm>(args, ws + l.cutlass_ws, stream, G::kName);
}

// A compiled instance of a GEMM family, as the family's dispatch table holds it.
template <class Problem>
struct CompiledGemm {
  size_t (*workspace_bytes)(int num_groups, int sm_count) = nullptr;
  std::string (*run)(const Problem& problem, void* workspace, size_t workspace_bytes,
                     int sm_count, cudaStream_t stream) = nullptr;
};

}  // namespace megamoe::gemm
