// CUTLASS 3.x (CuTe) Hopper grouped GEMM over token rows sorted by expert: one persistent
// TMA + wgmma warp-specialised kernel per layout, its per-group problem shapes, pointers and
// strides written on the device by a small prepare kernel from the group offsets, so the host
// never learns the group sizes (no sync; CUDA-graph friendly). Included by one .cu per layout.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ffi/gemm/grouped_gemm.h"

namespace megamoe::grouped::sm90 {

using namespace cute;

// Layout tags for the three GEMMs of the MLP (see grouped_gemm.h).
template <GemmKind Kind>
struct KindLayouts;
template <>
struct KindLayouts<GemmKind::kFprop> {  // A [rows, K] K-major, B [K, N] N-major
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct KindLayouts<GemmKind::kDgrad> {  // A [rows, K] K-major, B [N, K] K-major
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct KindLayouts<GemmKind::kWgrad> {  // A [T, M] M-major, B [T, N] N-major
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// Tile schedules (kernel + epilogue schedule, CTA tile, cluster), chosen per GEMM by variant.
struct Cooperative128x256Cluster2x1 {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Cooperative256x128Cluster2x1 {
  using TileShape = Shape<_256, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong128x128Cluster2x1 {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <GemmKind Kind, class Schedule, class ElementD_>
struct GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = ElementD_;
  using ElementAcc = float;
  using LayoutA = typename KindLayouts<Kind>::A;
  using LayoutB = typename KindLayouts<Kind>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 8;
  static constexpr int kAlignB = 8;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      void, LayoutD*, kAlignD,  // no source C
      ElementD, LayoutD*, kAlignD,
      typename Schedule::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, void, ElementAcc>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
      LayoutB*, kAlignB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

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

// Per-group argument arrays in the workspace, then CUTLASS's own workspace.
template <class G>
struct WorkspaceLayout {
  static constexpr size_t kAlign = 256;
  static size_t Round(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, cutlass_ws, end;
  explicit WorkspaceLayout(int e) {
    size_t o = 0;
    shapes = o;   o += Round(sizeof(typename G::Shape3) * e);
    ptr_a = o;    o += Round(sizeof(void*) * e);
    ptr_b = o;    o += Round(sizeof(void*) * e);
    ptr_d = o;    o += Round(sizeof(void*) * e);
    stride_a = o; o += Round(sizeof(typename G::StrideA) * e);
    stride_b = o; o += Round(sizeof(typename G::StrideB) * e);
    stride_d = o; o += Round(sizeof(typename G::StrideD) * e);
    cutlass_ws = o;
    end = o;
  }
};

template <class G, GemmKind Kind>
__global__ void PrepareGroupedGemm(int num_groups, const int32_t* __restrict__ offsets,
                                   const typename G::ElementA* a, const typename G::ElementB* b,
                                   typename G::ElementD* d, int64_t m, int64_t n, int64_t k,
                                   typename G::Shape3* shapes, const typename G::ElementA** ptr_a,
                                   const typename G::ElementB** ptr_b,
                                   typename G::ElementD** ptr_d, typename G::StrideA* stride_a,
                                   typename G::StrideB* stride_b, typename G::StrideD* stride_d) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= num_groups) return;
  const int64_t r0 = offsets[g];
  const int64_t rows = offsets[g + 1] - r0;
  if constexpr (Kind == GemmKind::kWgrad) {
    // An empty group gets no tiles (M = 0): its output is zeroed by the caller.
    shapes[g] = typename G::Shape3(rows > 0 ? int(m) : 0, int(n), int(rows));
    ptr_a[g] = a + r0 * m;
    ptr_b[g] = b + r0 * n;
    ptr_d[g] = d + int64_t(g) * m * n;
    stride_a[g] = LeadingStride<typename G::StrideA>(m);
    stride_b[g] = LeadingStride<typename G::StrideB>(n);
  } else {
    shapes[g] = typename G::Shape3(int(rows), int(n), int(k));
    ptr_a[g] = a + r0 * k;
    ptr_b[g] = b + int64_t(g) * k * n;
    ptr_d[g] = d + r0 * n;
    stride_a[g] = LeadingStride<typename G::StrideA>(k);
    stride_b[g] = LeadingStride<typename G::StrideB>(Kind == GemmKind::kFprop ? n : k);
  }
  stride_d[g] = LeadingStride<typename G::StrideD>(n);
}

template <class G>
typename G::Gemm::Arguments MakeArguments(const WorkspaceLayout<G>& layout, uint8_t* ws,
                                          int num_groups, int sm_count, int max_active_clusters) {
  typename G::Gemm::Arguments args;
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  hw.max_active_clusters = max_active_clusters;
  typename G::Shape3* shapes = reinterpret_cast<typename G::Shape3*>(ws + layout.shapes);
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  args = typename G::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_groups, shapes, nullptr},
      {reinterpret_cast<const typename G::ElementA**>(ws + layout.ptr_a),
       reinterpret_cast<typename G::StrideA*>(ws + layout.stride_a),
       reinterpret_cast<const typename G::ElementB**>(ws + layout.ptr_b),
       reinterpret_cast<typename G::StrideB*>(ws + layout.stride_b)},
      {fusion, nullptr, reinterpret_cast<typename G::StrideD*>(ws + layout.stride_d),
       reinterpret_cast<typename G::ElementD**>(ws + layout.ptr_d),
       reinterpret_cast<typename G::StrideD*>(ws + layout.stride_d)},
      hw};
  return args;
}

template <class G>
int MaxActiveClusters() {
  // Per device; queried once (host only, not a stream operation).
  static std::once_flag once[64];
  static int value[64];
  int dev = 0;
  cudaGetDevice(&dev);
  dev &= 63;
  std::call_once(once[dev], [&] {
    cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                         int(sizeof(typename G::Kernel::SharedStorage)));
    value[dev] = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename G::Kernel>();
  });
  return value[dev];
}

template <class G>
size_t WorkspaceBytes(int num_groups, int sm_count) {
  WorkspaceLayout<G> layout(num_groups);
  typename G::Gemm::Arguments args = MakeArguments<G>(layout, nullptr, num_groups, sm_count, 0);
  return layout.end + G::Gemm::get_workspace_size(args);
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

template <class G, GemmKind Kind>
std::string Run(const GroupedGemmProblem& p, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream) {
  WorkspaceLayout<G> layout(p.num_groups);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  typename G::Gemm::Arguments args =
      MakeArguments<G>(layout, ws, p.num_groups, sm_count, MaxActiveClusters<G>());
  const size_t need = layout.end + G::Gemm::get_workspace_size(args);
  if (need > workspace_bytes) {
    return "grouped GEMM workspace too small: need " + std::to_string(need) + " bytes, have " +
           std::to_string(workspace_bytes);
  }
  const int threads = 128;
  PrepareGroupedGemm<G, Kind><<<(p.num_groups + threads - 1) / threads, threads, 0, stream>>>(
      p.num_groups, p.offsets, static_cast<const typename G::ElementA*>(p.a),
      static_cast<const typename G::ElementB*>(p.b), static_cast<typename G::ElementD*>(p.d),
      p.m, p.n, p.k, reinterpret_cast<typename G::Shape3*>(ws + layout.shapes),
      reinterpret_cast<const typename G::ElementA**>(ws + layout.ptr_a),
      reinterpret_cast<const typename G::ElementB**>(ws + layout.ptr_b),
      reinterpret_cast<typename G::ElementD**>(ws + layout.ptr_d),
      reinterpret_cast<typename G::StrideA*>(ws + layout.stride_a),
      reinterpret_cast<typename G::StrideB*>(ws + layout.stride_b),
      reinterpret_cast<typename G::StrideD*>(ws + layout.stride_d));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("prepare kernel launch: ") + cudaGetErrorString(err);

  return RunCutlass<typename G::Gemm>(args, ws + layout.cutlass_ws, stream, "grouped GEMM");
}

}  // namespace megamoe::grouped::sm90

// Defines GroupedGemm<KIND>V<VARIANT>WorkspaceBytes / RunGroupedGemm<KIND>V<VARIANT> for one
// instantiation (one per .cu file, so that they compile in parallel).
#define MEGAMOE_DEFINE_GROUPED_GEMM(KIND, VARIANT, SCHEDULE)                                    \
  namespace megamoe::grouped {                                                                  \
  using KIND##V##VARIANT##Config =                                                              \
      sm90::GroupedGemm<GemmKind::k##KIND, sm90::SCHEDULE, cutlass::bfloat16_t>;                \
  size_t GroupedGemm##KIND##V##VARIANT##WorkspaceBytes(int num_groups, int sm_count) {          \
    return sm90::WorkspaceBytes<KIND##V##VARIANT##Config>(num_groups, sm_count);                \
  }                                                                                             \
  std::string RunGroupedGemm##KIND##V##VARIANT(const GroupedGemmProblem& p, void* workspace,    \
                                               size_t workspace_bytes, int sm_count,            \
                                               cudaStream_t stream) {                           \
    return sm90::Run<KIND##V##VARIANT##Config, GemmKind::k##KIND>(p, workspace,                 \
                                                                  workspace_bytes, sm_count,    \
                                                                  stream);                      \
  }                                                                                             \
  }
