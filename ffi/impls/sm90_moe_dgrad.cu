// The dgrad core of the grouped MLP's backward on sm_90a (see moe_dgrad.h): the tile engine with
// kDgrad, one persistent launch per GEMM kind. The dh launch writes dgate_up, which the dx
// launch reads, so stream order is the only synchronisation: no CTA waits on another, and the
// kernels may share the GPU with anything XLA runs beside them. Rows past offsets[E] are not
// written (the handler zeroes dx's).
#include <cuda.h>
#include <cuda_bf16.h>

#include <string>

#include "ffi/common/device_info.h"
#include "ffi/common/launch_counts.h"
#include "ffi/gemm/sm90_moe_tile_engine.cuh"
#include "ffi/gemm/sm90_tensor_maps.cuh"
#include "ffi/heuristics/moe_dgrad_core.h"
#include "ffi/impls/moe_dgrad.h"
#include "ffi/scheduler/expert_tile_walk.cuh"
#include "ffi/scheduler/one_kind_schedule.cuh"

namespace megamoe::grouped {
namespace {

using fused::ExpertTile;
using Engine = fused::sm90::Sm90MoeTileEngine<4, 4, fused::sm90::Bf16Operands,
                                              /*kBKMajor=*/true, /*kDgrad=*/true>;
using Walk = fused::ExpertTileWalk<Engine::kBlockM, kMoeDgradMaxExperts>;

// dx rows stay in group order: row r of a tile goes to base + (row_begin + r) * ld.
struct GroupRowDest {
  __nv_bfloat16* base;
  int64_t ld;
  __device__ __forceinline__ __nv_bfloat16* row(const ExpertTile& t, int r) const {
    return base + int64_t(t.row_begin + r) * ld;
  }
};
using Params = fused::sm90::EngineParams<GroupRowDest>;

struct Smem {
  Engine::SharedStorage engine;
  Walk::SharedStorage walk;
};
static_assert(sizeof(Smem) <= 227 * 1024, "the engine and the walk exceed sm_90's shared memory");

__global__ void __launch_bounds__(Engine::kThreads, 1)
    MoeDgradKernel(const __grid_constant__ Params p, const int32_t* offsets, int num_experts,
                   int kind, int n_blocks, int n_major) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& st = *reinterpret_cast<Smem*>(smem_raw);
  if ((fused::sm90::detail::smem_u32(smem_raw) & 1023) != 0) __trap();  // 128B swizzle
  if (threadIdx.x == 0) Engine::init(st.engine);
  fused::OneKindSchedule<Walk> sched;
  if (threadIdx.x < 32)  // the producer warp: the only one that asks for tiles
    sched.init(&st.walk, offsets, num_experts, threadIdx.x, kind, n_blocks, n_major != 0);
  __syncthreads();
  Engine::run_roles(st.engine, p, sched, fused::sm90::NoHooks{});
}

}  // namespace

std::string MoeDgradUnsupportedReason(int64_t hidden, int64_t ffn, int64_t num_experts) {
  if (hidden < 256 || ffn < 256 || hidden % 256 != 0 || ffn % 256 != 0)
    return "H=" + std::to_string(hidden) + " and F=" + std::to_string(ffn) +
           " must be positive multiples of 256 (the core's 256-column tiles)";
  if (num_experts > kMoeDgradMaxExperts)
    return std::to_string(num_experts) + " experts, at most " +
           std::to_string(kMoeDgradMaxExperts);
  if (CurrentDeviceComputeMajor() != 9) return "the core is sm_90a only (wgmma, TMA)";
  return "";
}

std::string MoeDgradSm90(const MoeDgradProblem& p, cudaStream_t stream) {
  if (std::string why = MoeDgradUnsupportedReason(p.hidden, p.ffn, p.num_experts); !why.empty())
    return "dgrad core: " + why;
  const int64_t H = p.hidden, F = p.ffn, E = p.num_experts;
  Params prm{};
  fused::sm90::GemmOperands& dh = prm.op[fused::sm90::kDgradDh];
  fused::sm90::GemmOperands& dx = prm.op[fused::sm90::kDgradDx];
  std::string err;
  // A: rows in group order, box {64 K, 128 rows}; B: the weights as stored, read as [E * N, K]
  // (w_down [E, F, H] -> N = F, K = H; w_gate_up [E, H, 2F] -> N = H, K = 2F), box {64, 128}.
  // Rows past n read as zeros (TMA bounds); an expert's partial M-block reads the next
  // expert's rows into accumulator rows that are never stored.
  if (!(err = fused::MakeRowMajorTensorMap(&dh.a_map, p.dy, p.n, H, H, 64, 128)).empty() ||
      !(err = fused::MakeRowMajorTensorMap(&dh.b_map, p.w_down, E * F, H, H, 64, 128)).empty() ||
      !(err = fused::MakeRowMajorTensorMap(&dx.a_map, p.dgate_up, p.n, 2 * F, 2 * F, 64, 128))
           .empty() ||
      !(err = fused::MakeRowMajorTensorMap(&dx.b_map, p.w_gate_up, E * H, 2 * F, 2 * F, 64, 128))
           .empty()) {
    return "dgrad core: " + err;
  }
  dh.n = int(F);
  dh.k = int(H);
  dh.a_load = int32_t(fused::sm90::ALoad::kTmaBlock);
  dx.n = int(H);
  dx.k = int(2 * F);
  dx.a_load = int32_t(fused::sm90::ALoad::kTmaBlock);
  prm.f = int(F);
  prm.fwd_gate_up = static_cast<const __nv_bfloat16*>(p.gate_up);
  prm.dgate_up = static_cast<__nv_bfloat16*>(p.dgate_up);
  prm.l2_dest = GroupRowDest{static_cast<__nv_bfloat16*>(p.dx), H};

  const size_t smem = sizeof(Smem);
  if (cudaError_t e = cudaFuncSetAttribute(MoeDgradKernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess) {
    return std::string("dgrad core: shared memory attribute: ") + cudaGetErrorString(e);
  }
  const int grid = CurrentDeviceSmCount();
  const int dx_n_major = heuristics::MoeDgradDxNMajor(H, F) ? 1 : 0;
  MoeDgradKernel<<<grid, Engine::kThreads, smem, stream>>>(prm, p.offsets, p.num_experts,
                                                           fused::sm90::kDgradDh, int(F / 256), 0);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("dgrad core: dh launch: ") + cudaGetErrorString(e);
  MoeDgradKernel<<<grid, Engine::kThreads, smem, stream>>>(
      prm, p.offsets, p.num_experts, fused::sm90::kDgradDx, int(H / 256), dx_n_major);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("dgrad core: dx launch: ") + cudaGetErrorString(e);
  CountLaunch(CountedLaunch::kMoeDgradCore);
  return "";
}

}  // namespace megamoe::grouped
