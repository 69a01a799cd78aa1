// Blockwise-scaled FP8 grouped GEMMs (gemm/grouped_gemm_fp8.h), templated over the tile schedule and the
// scale layout: CUTLASS sm90 ptr-array kernel with per-128-K promotion of the fp32 accumulators
// (FP8Blockwise kernel schedules). D bf16. Two problems:
//   fprop/dgrad  A = rows e4m3 [rows, K] with 1x128 scales (K-major, [rows, K/128]),
//                B = weights e4m3 [E, N, K] (K-major) with 128x128 scales [E, K/128, N/128].
//   wgrad        A, B = weight-gradient operands e4m3 [Ca | Cb, length] (K = the group's padded
//                rows, K-major) with 128x1 scales [length/128, Ca | Cb] (M- / N-major).
// Each sm90_grouped_gemm_fp8_v<N>.cu / sm90_grouped_wgrad_fp8_v<N>.cu instantiates one schedule
// (they compile in parallel); grouped_gemm_fp8.cu picks one of each at run time.
// CUTLASS asserts inside the wgmma consumer loop become function calls that serialise wgmma
// (ptxas C7510): every including TU defines NDEBUG before any include.
#pragma once

#include "ffi/gemm/grouped_gemm_runner.cuh"
#include "ffi/gemm/grouped_gemm_fp8.h"

#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace megamoe::grouped::fp8 {

using namespace cute;

// Tile schedules: CTA tile, cluster, kernel and epilogue schedule.
struct Cooperative128x128Cluster1x2 {
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Cooperative128x128Cluster2x1 {
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// 64-row tiles: half the padding of a group's last, partial M tile (with ~1,000 rows per
// expert the 128-row tile computes ~6% padding).
struct Pingpong64x128Cluster1x2 {
  using TileShape = Shape<_64, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Scale layouts. The kernel rebuilds each group's scale layouts from its (M, N, K) (it ignores
// the layouts passed in), packed per group, so the scales must be laid out so that a group's are
// one contiguous, packed slice:
//   rows x weights: K-major SFA, a group's rows [r0, r0 + M) of the [rows, K/128] matrix; SFB
//     [K/128, N/128] per expert.
//   wgrad: M-/N-major SFA/SFB, a group's K blocks [k0, k0 + K/128) of [length/128, Ca | Cb].
using RowsTimesWeightsScales = cutlass::detail::Sm90BlockwiseScaleConfig<
    1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
using WgradScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::MN>;

template <class Schedule, class Scales = RowsTimesWeightsScales>
struct Fp8Gemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  using ScaleConfig = Scales;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc, void, LayoutD*, 8,
      ElementD, LayoutD*, 8, typename Schedule::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, void, ElementAcc>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, 16, ElementB, cute::tuple<LayoutB*, LayoutSFB*>, 16,
      ElementAcc, TileShape, ClusterShape,
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

template <class G>
struct Fp8Layout {
  static size_t Round(size_t x) { return (x + 255) / 256 * 256; }
  size_t shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d, layout_sfa,
      layout_sfb, cutlass_ws;
  explicit Fp8Layout(int e) {
    size_t o = 0;
    shapes = o;     o += Round(sizeof(typename G::Shape3) * e);
    ptr_a = o;      o += Round(sizeof(void*) * e);
    ptr_b = o;      o += Round(sizeof(void*) * e);
    ptr_d = o;      o += Round(sizeof(void*) * e);
    ptr_sfa = o;    o += Round(sizeof(void*) * e);
    ptr_sfb = o;    o += Round(sizeof(void*) * e);
    stride_a = o;   o += Round(sizeof(typename G::StrideA) * e);
    stride_b = o;   o += Round(sizeof(typename G::StrideB) * e);
    stride_d = o;   o += Round(sizeof(typename G::StrideD) * e);
    layout_sfa = o; o += Round(sizeof(typename G::LayoutSFA) * e);
    layout_sfb = o; o += Round(sizeof(typename G::LayoutSFB) * e);
    cutlass_ws = o;
  }
};

// The per-group argument arrays in the workspace, as the prepare kernels write them.
template <class G>
struct Fp8GroupArgs {
  typename G::Shape3* shapes;
  const typename G::ElementA** ptr_a;
  const typename G::ElementB** ptr_b;
  typename G::ElementD** ptr_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  typename G::LayoutSFA* layout_sfa;
  typename G::LayoutSFB* layout_sfb;

  Fp8GroupArgs(const Fp8Layout<G>& l, uint8_t* ws)
      : shapes(reinterpret_cast<typename G::Shape3*>(ws + l.shapes)),
        ptr_a(reinterpret_cast<const typename G::ElementA**>(ws + l.ptr_a)),
        ptr_b(reinterpret_cast<const typename G::ElementB**>(ws + l.ptr_b)),
        ptr_d(reinterpret_cast<typename G::ElementD**>(ws + l.ptr_d)),
        ptr_sfa(reinterpret_cast<const float**>(ws + l.ptr_sfa)),
        ptr_sfb(reinterpret_cast<const float**>(ws + l.ptr_sfb)),
        stride_a(reinterpret_cast<typename G::StrideA*>(ws + l.stride_a)),
        stride_b(reinterpret_cast<typename G::StrideB*>(ws + l.stride_b)),
        stride_d(reinterpret_cast<typename G::StrideD*>(ws + l.stride_d)),
        layout_sfa(reinterpret_cast<typename G::LayoutSFA*>(ws + l.layout_sfa)),
        layout_sfb(reinterpret_cast<typename G::LayoutSFB*>(ws + l.layout_sfb)) {}

  // Group g: D [m, n] (row stride ldd) = A [m, k] (row stride lda) B[n, k]^T (row stride ldb).
  __device__ void Set(int g, int m, int n, int k, const void* a, int64_t lda, const void* b,
                      int64_t ldb, void* d, int64_t ldd, const float* sfa,
                      const float* sfb) const {
    shapes[g] = typename G::Shape3(m, n, k);
    ptr_a[g] = static_cast<const typename G::ElementA*>(a);
    ptr_b[g] = static_cast<const typename G::ElementB*>(b);
    ptr_d[g] = static_cast<typename G::ElementD*>(d);
    ptr_sfa[g] = sfa;
    ptr_sfb[g] = sfb;
    stride_a[g] = sm90::LeadingStride<typename G::StrideA>(lda);
    stride_b[g] = sm90::LeadingStride<typename G::StrideB>(ldb);
    stride_d[g] = sm90::LeadingStride<typename G::StrideD>(ldd);
    layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  }
};

// Rows of group g (A, 1x128 scales) times expert g's weights (B, 128x128 scales).
template <class G>
__global__ void PrepareRowsTimesWeights(GroupedGemmFp8Problem p, Fp8GroupArgs<G> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int64_t r0 = p.offsets[g];
  const int rows = int(p.offsets[g + 1] - r0);
  const int64_t kbs = p.k / 128, nbs = p.n / 128;
  args.Set(g, rows, int(p.n), int(p.k), static_cast<const uint8_t*>(p.a) + r0 * p.lda, p.lda,
           static_cast<const uint8_t*>(p.b) + int64_t(g) * p.n * p.k, p.k,
           static_cast<typename G::ElementD*>(p.d) + r0 * p.n, p.n, p.a_scale + r0 * kbs,
           p.b_scale + int64_t(g) * kbs * nbs);
}

// Group g's padded columns of both operands; an empty group gets no tiles (M = 0).
template <class G>
__global__ void PrepareWgrad(GroupedWgradFp8Problem p, Fp8GroupArgs<G> args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const bool empty = p.offsets[g + 1] == p.offsets[g];
  const int64_t c0 = p.padded[g];
  const int k = int(p.padded[g + 1] - c0);
  args.Set(g, empty ? 0 : int(p.ca), int(p.cb), k, static_cast<const uint8_t*>(p.a) + c0,
           p.length, static_cast<const uint8_t*>(p.b) + c0, p.length,
           static_cast<typename G::ElementD*>(p.d) + int64_t(g) * p.ca * p.cb, p.cb,
           p.a_scale + c0 / 128 * p.ca, p.b_scale + c0 / 128 * p.cb);
}

template <class G>
typename G::Gemm::Arguments MakeArgs(const Fp8Layout<G>& l, uint8_t* ws, int e, int sm_count,
                                     int max_active_clusters) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  hw.max_active_clusters = max_active_clusters;
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  const Fp8GroupArgs<G> a(l, ws);
  args = typename G::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {e, a.shapes, nullptr},
      {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_sfa, a.layout_sfa, a.ptr_sfb,
       a.layout_sfb},
      {fusion, nullptr, a.stride_d, a.ptr_d, a.stride_d},
      hw};
  return args;
}

template <class G>
size_t WorkspaceBytes(int num_groups, int sm_count) {
  Fp8Layout<G> l(num_groups);
  return l.cutlass_ws +
         G::Gemm::get_workspace_size(MakeArgs<G>(l, nullptr, num_groups, sm_count, 0));
}

// Writes the argument arrays with `prepare(args, stream)` (a kernel launch), then runs the GEMM.
template <class G, class Prepare>
std::string Run(int num_groups, Prepare prepare, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream) {
  Fp8Layout<G> l(num_groups);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  auto args = MakeArgs<G>(l, ws, num_groups, sm_count, sm90::MaxActiveClusters<G>());
  const size_t need = l.cutlass_ws + G::Gemm::get_workspace_size(args);
  if (need > workspace_bytes) {
    return "FP8 grouped GEMM workspace too small: need " + std::to_string(need) + " bytes, have " +
           std::to_string(workspace_bytes);
  }
  prepare(Fp8GroupArgs<G>(l, ws), stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("FP8 GEMM prepare launch: ") + cudaGetErrorString(err);
  return sm90::RunCutlass<typename G::Gemm>(args, ws + l.cutlass_ws, stream, "FP8 grouped GEMM");
}

template <class G>
std::string RunRowsTimesWeights(const GroupedGemmFp8Problem& p, void* ws, size_t ws_bytes,
                                int sm_count, cudaStream_t stream) {
  if (p.k % 128 != 0 || p.n % 128 != 0) {
    return "FP8 grouped GEMM needs K and N multiples of 128, got K=" + std::to_string(p.k) +
           " N=" + std::to_string(p.n);
  }
  auto prepare = [&p](const Fp8GroupArgs<G>& args, cudaStream_t s) {
    PrepareRowsTimesWeights<G><<<(p.num_groups + 127) / 128, 128, 0, s>>>(p, args);
  };
  return Run<G>(p.num_groups, prepare, ws, ws_bytes, sm_count, stream);
}

template <class G>
std::string RunWgrad(const GroupedWgradFp8Problem& p, void* ws, size_t ws_bytes, int sm_count,
                     cudaStream_t stream) {
  auto prepare = [&p](const Fp8GroupArgs<G>& args, cudaStream_t s) {
    PrepareWgrad<G><<<(p.num_groups + 127) / 128, 128, 0, s>>>(p, args);
  };
  return Run<G>(p.num_groups, prepare, ws, ws_bytes, sm_count, stream);
}

}  // namespace megamoe::grouped::fp8

// Defines GroupedGemmFp8V<VARIANT>WorkspaceBytes / RunGroupedGemmFp8V<VARIANT> (gemm/grouped_gemm_fp8.h
// signatures) for one schedule.
#define MEGAMOE_DEFINE_GROUPED_GEMM_FP8(VARIANT, SCHEDULE)                                     \
  namespace megamoe::grouped {                                                                \
  size_t GroupedGemmFp8V##VARIANT##WorkspaceBytes(int num_groups, int sm_count) {             \
    return fp8::WorkspaceBytes<fp8::Fp8Gemm<fp8::SCHEDULE>>(num_groups, sm_count);            \
  }                                                                                           \
  std::string RunGroupedGemmFp8V##VARIANT(const GroupedGemmFp8Problem& p, void* ws,           \
                                          size_t ws_bytes, int sm_count, cudaStream_t stream) { \
    return fp8::RunRowsTimesWeights<fp8::Fp8Gemm<fp8::SCHEDULE>>(p, ws, ws_bytes, sm_count,   \
                                                                 stream);                     \
  }                                                                                           \
  }

// Defines GroupedWgradFp8V<VARIANT>WorkspaceBytes / RunGroupedWgradFp8V<VARIANT> for one
// schedule of the K-grouped weight gradient (128x1 scales on both operands).
#define MEGAMOE_DEFINE_GROUPED_WGRAD_FP8(VARIANT, SCHEDULE)                                    \
  namespace megamoe::grouped {                                                                \
  size_t GroupedWgradFp8V##VARIANT##WorkspaceBytes(int num_groups, int sm_count) {            \
    return fp8::WorkspaceBytes<fp8::Fp8Gemm<fp8::SCHEDULE, fp8::WgradScales>>(num_groups,     \
                                                                              sm_count);      \
  }                                                                                           \
  std::string RunGroupedWgradFp8V##VARIANT(const GroupedWgradFp8Problem& p, void* ws,         \
                                           size_t ws_bytes, int sm_count,                     \
                                           cudaStream_t stream) {                             \
    return fp8::RunWgrad<fp8::Fp8Gemm<fp8::SCHEDULE, fp8::WgradScales>>(p, ws, ws_bytes,      \
                                                                        sm_count, stream);    \
  }                                                                                           \
  }
