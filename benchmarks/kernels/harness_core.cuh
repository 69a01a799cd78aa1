// What the standalone harnesses of the tile engine share (fused_core_bench.cu: the forward's
// GEMMs; fused_dgrad_bench.cu: the backward's dgrad GEMMs): the harness kernel (a static tile
// schedule of two GEMM kinds, the second kind's tiles waiting for all of the first kind's tiles
// of their M-block; or, experimental, 2-CTA clusters sharing B), random fills, an fp32 reference GEMM, error accumulation and counts, the
// routed and sized problems, and the sampled rows that are checked.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "benchmarks/kernels/harness_host.h"
#include "ffi/gemm/sm90_moe_tile_engine.cuh"
#include "ffi/scheduler/expert_tile_walk.cuh"
#include "ffi/scheduler/one_kind_schedule.cuh"

using namespace megamoe::fused;
using namespace megamoe::fused::sm90;
using bf16 = __nv_bfloat16;

// ------------------------------------------------------------------ scheduler + hooks
struct StaticScheduler {
  Walk walk;
  int t, stride, l1_tiles, total, nb1, nb2, c1, c2;
  int n_major;  // bit 0: L1 tiles N-block-major inside an expert, bit 1: L2 tiles
  __device__ __forceinline__ bool next(ExpertTile& job) {
    if (t >= total) return false;
    job = t < l1_tiles ? walk.decode(t, nb1, kL1GateUp, c1, n_major & 1)
                       : walk.decode(t - l1_tiles, nb2, kL2Down, c2, (n_major >> 1) & 1);
    t += stride;
    return true;
  }
};

// L1 tiles count per M-block; an L2 tile waits until all nb1 L1 tiles of its M-block are done
// (counters accumulate over launches: target = (epoch + 1) * nb1).
struct MBlockHooks {
  static constexpr int kStoreFence = 1;  // h is read by other CTAs of this launch
  int* mb_done;
  int target;
  __device__ __forceinline__ void wait_rows_ready(const ExpertTile& t) const {
    if (mb_done == nullptr || t.kind != kL2Down) return;
    const int* c = mb_done + t.mb_global;
    long long spins = 0;
    while (true) {
      int v;
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
      if (v >= target) break;
      if (++spins > (1ll << 26)) __trap();  // no printf: a call would serialise wgmma (C7510)
    }
  }
  __device__ __forceinline__ void tile_done(const ExpertTile& t) const {
    if (mb_done == nullptr || t.kind != kL1GateUp) return;
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(mb_done + t.mb_global)
                 : "memory");
  }
};

struct RunArgs {
  const int32_t* offsets;
  int num_experts;
  int mode;  // 1 = L1, 2 = L2, 3 = L1 then L2 in one launch
  int nb1, nb2;
  int n_major;
  MBlockHooks hooks;
};

template <class Engine>
struct KernelStorage {
  typename Engine::SharedStorage engine;
  Walk::SharedStorage walk;
};

template <class Engine>
__global__ void __launch_bounds__(384, 1)
    MoeCoreKernel(const __grid_constant__ Params p, const RunArgs args) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& st = *reinterpret_cast<KernelStorage<Engine>*>(smem_raw);
  if ((detail::smem_u32(smem_raw) & 1023) != 0) __trap();
  if (threadIdx.x == 0) Engine::init(st.engine);
  StaticScheduler sched;
  if (threadIdx.x < 32) {
    sched.walk.build(&st.walk, args.offsets, args.num_experts, threadIdx.x);
    const int mb = sched.walk.num_m_blocks();
    sched.t = blockIdx.x;
    sched.stride = gridDim.x;
    sched.l1_tiles = (args.mode & 1) ? mb * args.nb1 : 0;
    sched.total = sched.l1_tiles + ((args.mode & 2) ? mb * args.nb2 : 0);
    sched.nb1 = args.nb1;
    sched.nb2 = args.nb2;
    sched.c1 = 0;
    sched.c2 = 0;
    sched.n_major = args.n_major;
  }
  __syncthreads();
  Engine::run_roles(st.engine, p, sched, args.hooks);
}

// ------------------------------------------------------------------ 2-CTA clusters sharing B
// The engine's experimental kClusterM = 2: a cluster takes a 256-row pair of M-blocks of one
// expert and N-block, each CTA one M-block (0 rows when the expert has an odd number), both
// sharing the B stages. One GEMM kind per launch (no counters: a RunArgs mode of 3 launches
// the first kind, then the second).
using PairWalk = ExpertTileWalk<256, kMaxExperts>;

template <class Engine>
struct ClusterStorage {
  typename Engine::SharedStorage engine;
  PairWalk::SharedStorage walk;
};

// The CTA's half of its cluster's pair tile: M-block 2 p + rank (0 rows past the expert's end).
// m_block, mb_global and tile stay the pair's: no counter hooks may key on them (NoHooks).
struct PairSchedule {
  OneKindSchedule<PairWalk> pairs;
  int rank;
  __device__ __forceinline__ bool next(ExpertTile& job) {
    if (!pairs.next(job)) return false;
    job.row_begin += 128 * rank;
    job.rows = max(0, min(128, job.rows - 128 * rank));
    return true;
  }
};

template <class Engine>
__global__ void __launch_bounds__(384, 1)
    ClusterPairKernel(const __grid_constant__ Params p, const RunArgs args, int kind) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& st = *reinterpret_cast<ClusterStorage<Engine>*>(smem_raw);
  if ((detail::smem_u32(smem_raw) & 1023) != 0) __trap();
  if (cute::cluster_shape().x != 2) __trap();  // multicast and remote arrives need the peer
  if (threadIdx.x == 0) Engine::init(st.engine);
  PairSchedule sched;
  if (threadIdx.x < 32) {
    sched.pairs.init(&st.walk, args.offsets, args.num_experts, threadIdx.x, kind,
                     kind == 0 ? args.nb1 : args.nb2, (args.n_major >> kind) & 1);
    sched.pairs.t = blockIdx.x / 2;  // one pair tile per cluster
    sched.pairs.stride = gridDim.x / 2;
    sched.rank = int(cute::block_rank_in_cluster());
  }
  __syncthreads();
  cute::cluster_sync();  // both CTAs' barriers initialised before any multicast or remote arrive
  Engine::run_roles(st.engine, p, sched, NoHooks{});
  cute::cluster_sync();  // neither CTA exits while its peer may still write into it
}

// Launches args.mode's kinds (bit 0 the first, bit 1 the second), one after the other, on
// `grid` CTAs (even) in clusters of 2.
template <class Engine>
static void LaunchClusterPairs(const Params& p, const RunArgs& args, int grid, cudaStream_t s) {
  const size_t smem = sizeof(ClusterStorage<Engine>);
  static bool attr = false;  // per instantiation, once (outside the timed launches)
  if (!attr) {
    CK(cudaFuncSetAttribute(ClusterPairKernel<Engine>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    attr = true;
  }
  if (grid < 2) {
    fprintf(stderr, "cluster launch: grid %d < 2\n", grid);
    exit(2);
  }
  for (int kind = 0; kind < 2; ++kind) {
    if (!((args.mode >> kind) & 1)) continue;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid & ~1);
    config.blockDim = dim3(Engine::kThreads);
    config.dynamicSmemBytes = smem;
    config.stream = s;
    cudaLaunchAttribute attrs[1];
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = 2;
    attrs[0].val.clusterDim.y = 1;
    attrs[0].val.clusterDim.z = 1;
    config.attrs = attrs;
    config.numAttrs = 1;
    CK(cudaLaunchKernelEx(&config, ClusterPairKernel<Engine>, p, args, kind));
  }
}

// ------------------------------------------------------------------ helpers (device)
__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(x ^ (x >> 31));
}

__global__ void FillRandom(bf16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = (Hash(seed * 0x100000001B3ull + i) >> 8) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

// out[e, n, k] = in[e, k, n]: a weight [E, K, N] as the K-major [E, N, K] (simple, not fast).
__global__ void TransposeLast2(const bf16* in, bf16* out, int64_t e, int64_t k, int64_t n) {
  const int64_t total = e * k * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = i / (k * n), r = i % (k * n), kk = r / n, nn = r % n;
    out[(x * n + nn) * k + kk] = in[i];
  }
}

__global__ void FillU16(uint16_t* p, int64_t n, uint16_t v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

// out[s, n] = sum_k A[a_row[s], k] * W[expert[s]][k, n] in fp32 (W [E, K, N] row-major).
__global__ void RefRowGemm(const bf16* a, int64_t lda, const int32_t* a_row,
                           const int32_t* expert, const bf16* w, int64_t k, int64_t n,
                           float* out) {
  extern __shared__ float a_s[];
  const int s = blockIdx.x;
  const bf16* ar = a + int64_t(a_row[s]) * lda;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) a_s[i] = __bfloat162float(ar[i]);
  __syncthreads();
  const bf16* we = w + int64_t(expert[s]) * k * n;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float acc = 0.f;
    for (int64_t i = 0; i < k; ++i) acc = fmaf(a_s[i], __bfloat162float(we[i * n + j]), acc);
    out[int64_t(s) * n + j] = acc;
  }
}

struct ErrAcc {
  double diff2, ref2, max_abs, max_ref;
  unsigned long long nan, count;
};

__device__ void AtomicMaxD(double* p, double v) {
  unsigned long long* u = reinterpret_cast<unsigned long long*>(p);
  unsigned long long old = *u;
  while (__longlong_as_double(old) < v) {
    const unsigned long long prev = atomicCAS(u, old, __double_as_longlong(v));
    if (prev == old) break;
    old = prev;
  }
}

// One thread's error sums over the elements it compared, added into an ErrAcc at the end.
struct ErrSums {
  double d2 = 0, r2 = 0, ma = 0, mr = 0;
  unsigned long long nan = 0, cnt = 0;
  __device__ void add(float got, float ref) {
    if (!isfinite(got)) {
      ++nan;
      return;
    }
    const double d = double(got) - double(ref);
    d2 += d * d;
    r2 += double(ref) * ref;
    ma = fmax(ma, fabs(d));
    mr = fmax(mr, fabs(double(ref)));
    ++cnt;
  }
  __device__ void flush(ErrAcc* acc) const {
    atomicAdd(&acc->diff2, d2);
    atomicAdd(&acc->ref2, r2);
    AtomicMaxD(&acc->max_abs, ma);
    AtomicMaxD(&acc->max_ref, mr);
    atomicAdd(&acc->nan, nan);
    atomicAdd(&acc->count, cnt);
  }
};

// Counts elements equal to `v` among rows [r0, r1) of a [*, cols] u16 matrix.
__global__ void CountEq(const uint16_t* p, int64_t r0, int64_t r1, int64_t cols, uint16_t v,
                        unsigned long long* out) {
  unsigned long long c = 0;
  const int64_t n = (r1 - r0) * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    c += p[r0 * cols + i] == v;
  atomicAdd(out, c);
}

__global__ void CountDiff(const uint32_t* a, const uint32_t* b, int64_t n,
                          unsigned long long* out) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  atomicAdd(out, c);
}

// ------------------------------------------------------------------ host
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
};

struct Problem {
  std::string name;
  int e, h, f, t;
  std::vector<int32_t> offsets;    // [E + 1]
  std::vector<int32_t> row_token;  // [rows]
  std::vector<int32_t> dest_row;   // [rows] permutation
  bool check_all;
  int64_t rows() const { return offsets.back(); }
};

// Top-k routing (distinct experts per token): weights w_e (uniform when empty), Gumbel top-k.
static Problem Routed(const std::string& name, int e, int h, int f, int t, int topk,
                      double skew, uint64_t seed) {
  Problem p{name, e, h, f, t, {}, {}, {}, false};
  Rng rng(seed);
  std::vector<std::vector<int32_t>> per(e);
  std::vector<std::pair<double, int>> keys(e);
  for (int tok = 0; tok < t; ++tok) {
    for (int x = 0; x < e; ++x) {
      const double g = -std::log(-std::log(std::max(rng.uniform(), 1e-300)));
      keys[x] = {(skew > 0 ? -skew * std::log(double(x + 1)) : 0.0) + g, x};
    }
    std::partial_sort(keys.begin(), keys.begin() + topk, keys.end(),
                      [](auto& a, auto& b) { return a.first > b.first; });
    for (int k = 0; k < topk; ++k) per[keys[k].second].push_back(tok);
  }
  p.offsets.assign(e + 1, 0);
  for (int x = 0; x < e; ++x) {
    p.offsets[x + 1] = p.offsets[x] + int32_t(per[x].size());
    for (int32_t tok : per[x]) p.row_token.push_back(tok);
  }
  return p;
}

static Problem Sized(const std::string& name, int h, int f, const std::vector<int>& sizes,
                     uint64_t seed) {
  Problem p{name, int(sizes.size()), h, f, 0, {}, {}, {}, true};
  Rng rng(seed);
  p.offsets.assign(sizes.size() + 1, 0);
  for (size_t x = 0; x < sizes.size(); ++x) p.offsets[x + 1] = p.offsets[x] + sizes[x];
  p.t = std::max<int>(1, int(p.rows()));
  for (int64_t r = 0; r < p.rows(); ++r) p.row_token.push_back(int32_t(rng.next() % p.t));
  return p;
}

static void FinishProblem(Problem& p, uint64_t seed) {
  Rng rng(seed ^ 0x5555);
  const int64_t rows = p.rows();
  p.dest_row.resize(rows);
  std::iota(p.dest_row.begin(), p.dest_row.end(), 0);
  for (int64_t i = rows - 1; i > 0; --i) std::swap(p.dest_row[i], p.dest_row[rng.next() % (i + 1)]);
}

constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN that no kernel writes
constexpr int kPadRows = 256;         // rows past the end that must stay poisoned

struct CheckResult {
  bool ok = true;
  std::string msg;
};

static double RelErr(const ErrAcc& e) { return std::sqrt(e.diff2 / std::max(e.ref2, 1e-30)); }

static double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Median ms of `iters` timed calls of launch(i) on stream s (CUDA events around each call),
// after 3 warm-up calls; i counts from 0 over warm-up and timed calls alike (callers rotate
// their inputs with i & 1).
template <class LaunchI>
static double TimeLaunches(LaunchI launch, int iters, cudaStream_t s) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i) launch(i);
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    launch(i);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaDeviceSynchronize());
  for (int i = 0; i < iters; ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  return Median(ms);
}

static std::vector<int32_t> Samples(const Problem& p) {
  std::vector<int32_t> s;
  const int64_t rows = p.rows();
  if (p.check_all || rows <= 4096) {
    for (int64_t r = 0; r < rows; ++r) s.push_back(int32_t(r));
    return s;
  }
  for (int64_t r = 0; r < rows; r += 61) s.push_back(int32_t(r));
  for (int x = 0; x < p.e; ++x) {  // first and last row of every expert (partial tiles)
    if (p.offsets[x + 1] > p.offsets[x]) {
      s.push_back(p.offsets[x]);
      s.push_back(p.offsets[x + 1] - 1);
    }
  }
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// An exhaustive fast-path test kernel(mismatches, exact_path_count) over `cases` threads:
// prints its line and returns whether nothing mismatched.
template <class Kernel>
static bool RunFastPathTest(const char* what, Kernel kernel, int cases) {
  unsigned long long* c = DevAlloc<unsigned long long>(2);
  CK(cudaMemset(c, 0, 16));
  kernel<<<(cases + 255) / 256, 256>>>(c, c + 1);
  CK(cudaGetLastError());
  unsigned long long h[2];
  CK(cudaMemcpy(h, c, 16, cudaMemcpyDeviceToHost));
  CK(cudaFree(c));
  printf("%s: %s, %llu mismatches of %d, %llu on the exact path\n", what,
         h[0] == 0 ? "PASS" : "FAIL", h[0], cases, h[1]);
  return h[0] == 0;
}

// The problems both harnesses check and time: odd group sizes (all rows checked), one token
// over 128 experts, the 30B shape uniform and skewed, and (not quick) the 235B shape uniform,
// and skewed when `skewed_235b`.
static std::vector<Problem> StandardProblems(bool quick, bool skewed_235b) {
  std::vector<Problem> problems;
  problems.push_back(Sized("odd sizes E=16 H=512 F=256", 512, 256,
                           {0, 1, 127, 128, 129, 0, 255, 300, 1, 0, 513, 64, 7, 1000, 0, 2}, 7));
  problems.push_back(Routed("one token E=128 30B", 128, 2048, 768, 1, 8, 0.0, 8));
  problems.push_back(Routed("30B uniform", 128, 2048, 768, 16384, 8, 0.0, 1));
  problems.push_back(Routed("30B skewed", 128, 2048, 768, 16384, 8, 1.2, 2));
  if (!quick) {
    problems.push_back(Routed("235B uniform", 128, 4096, 1536, 16384, 8, 0.0, 3));
    if (skewed_235b) problems.push_back(Routed("235B skewed", 128, 4096, 1536, 16384, 8, 1.2, 4));
  }
  return problems;
}

