// Standalone harness for the dgrad GEMMs of the fused MoE backward (tile engine kDgrad,
// ffi/gemm/sm90_moe_tile_engine.cuh), one launch over grouped problems:
//   dh tiles:  dh = dy @ w_down[e]^T (w_down [E, F, H] read K-major as stored), epilogue the
//              SwiGLU backward from the forward's gate_up -> dgate_up [rows, 2F];
//   dx tiles:  dx = dgate_up @ w_gate_up[e]^T (w_gate_up [E, H, 2F] read K-major as stored),
//              each row to a per-row destination (a permutation stands in for the combine
//              slots); a dx tile waits for every dh tile of its M-block (per-block counters).
// Checks, outputs poisoned before every run:
//   - dgate_up bit for bit against backend cuda's own SwigluBackward kernel
//     (ffi/impls/grouped_swiglu.cu, linked in) run on the kernel's dh (stored for the check),
//     with gate outliers in every 61st row that send warps down the epilogue's exact path;
//   - dh against an fp32 GPU reference GEMM, dx against one on the kernel's dgate_up
//     (relative error < 1e-2: bf16 outputs);
//   - every row written, no pad row past the last group touched, bitwise run to run;
//   - the engine's sigmoid and SwiGLU-backward fast path against swiglu_math.cuh over every bf16
//     gate value.
// Timed with CUDA events (median after warm-up): the launch and each GEMM kind alone, then with
// the dh and / or dx tiles N-block-major inside an expert.
//
// Build: benchmarks/kernels/build_fused_core_bench.sh. Run: ./fused_dgrad_bench [--quick]
//   [--problem I] [--iters N] [--nocheck] [--cluster] (--cluster: the engine's experimental B
//   multicast over 2-CTA clusters, one GEMM kind per launch, so "one launch" is dh then dx).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "benchmarks/kernels/harness_core.cuh"
#include "ffi/gemm/sm90_tensor_maps.cuh"
#include "ffi/impls/grouped_swiglu.h"

using DgradEngine = Sm90MoeTileEngine<4, 4, Bf16Operands, /*kBKMajor=*/true, /*kDgrad=*/true>;

// --cluster: the engine's experimental B multicast over 2-CTA clusters (kClusterM = 2,
// harness_core.cuh's ClusterPairKernel), one GEMM kind per launch.
using ClusterEngine =
    Sm90MoeTileEngine<4, 4, Bf16Operands, /*kBKMajor=*/true, /*kDgrad=*/true, /*kClusterM=*/2>;
static bool g_cluster = false;


// The engine's SwiGLU-backward fast path (warp-wide exact fallback aside) against SwigluGrad:
// every bf16 gate value times a few (dh, up) pairs, fp32 bits compared; elements outside the
// fast path's range are counted (the engine recomputes those with SwigluGrad itself).
__global__ void SwigluGradExactTest(unsigned long long* mismatch, unsigned long long* slow_count) {
  const float ds[4] = {1.0f, -0.3359375f, 1e-20f, 3e4f};
  const float ups[4] = {1.0f, -7.5f, 0.0078125f, 65504.0f};
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536 * 16) return;
  const uint16_t gb = uint16_t(i & 0xffff);
  const float g = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&gb));
  const float d = ds[(i >> 16) & 3], u = ups[i >> 18];
  bool slow = false;
  float dg_fast, du_fast, dg, du;
  detail::swiglu_grad_fast_path(d, g, u, &dg_fast, &du_fast, slow);
  megamoe::grouped::SwigluGrad(d, g, u, &dg, &du);
  auto same = [](float a, float b) {
    return __float_as_uint(a) == __float_as_uint(b) || (isnan(a) && isnan(b));
  };
  if (slow) atomicAdd(slow_count, 1ull);
  else if (!same(dg_fast, dg) || !same(du_fast, du)) atomicAdd(mismatch, 1ull);
}

// Gate values past the fast path's range (1 + exp(-g) >= 2^126: g < -87.3) in every 61st row,
// so that the epilogue's warp-wide exact path runs inside the kernel (dgate, dup stay finite).
__global__ void PlantGateOutliers(bf16* gu, int64_t rows, int64_t f) {
  const float values[4] = {-100.0f, -90.0f, -87.5f, -87.25f};
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    if (r % 61 != 0) continue;
    for (int i = 0; i < 4; ++i) gu[r * 2 * f + (r + 37 * i) % f] = __float2bfloat16(values[i]);
  }
}

// Compares got[got_row[s], j] (bf16) with ref[s, j] (fp32) for j < ncols.
__global__ void CompareRows(const bf16* got, int64_t ldg, const int32_t* got_row,
                            const float* ref, int64_t ncols, int num_samples, ErrAcc* acc) {
  ErrSums sums;
  for (int s = blockIdx.x; s < num_samples; s += gridDim.x)
    for (int64_t j = threadIdx.x; j < ncols; j += blockDim.x)
      sums.add(__bfloat162float(got[int64_t(got_row[s]) * ldg + j]), ref[s * ncols + j]);
  sums.flush(acc);
}

struct DgradProblem {
  const Problem* p;
  int64_t rows;
  bf16* dy[2];           // [R, H] rows in group order (two, rotated when timing)
  bf16 *gu, *w_gu, *w_d;  // the forward's gate_up [R, 2F]; weights as stored
  bf16 *w_gu_kn, *w_d_kn;  // the reference's [E, K, N] copies: [E, 2F, H] and [E, H, F]
  bf16 *dgu, *dh, *dx;   // outputs: dgate_up [R, 2F], dh [R, F] (check only), dx [R, H]
  int32_t *offsets, *dest_row;
  int* mb_done;
  int epoch;
  uint64_t gu_seed;
};


// gate and up values over [-4, 4] (the sigmoid's curve); with `outliers` (the checks, not the
// timing) gate values past the fast path's range too.
static void FillGateUp(DgradProblem& d, bool outliers) {
  const int64_t R = d.rows + kPadRows, F = d.p->f;
  FillRandom<<<2048, 256>>>(d.gu, R * 2 * F, d.gu_seed, 4.0f);
  if (outliers) PlantGateOutliers<<<256, 256>>>(d.gu, R, F);
  CK(cudaGetLastError());
}

static DgradProblem Upload(const Problem& p, uint64_t seed) {
  DgradProblem d{};
  d.p = &p;
  d.rows = p.rows();
  const int64_t H = p.h, F = p.f, E = p.e, R = d.rows + kPadRows;
  for (int i = 0; i < 2; ++i) {
    d.dy[i] = DevAlloc<bf16>(R * H);
    FillRandom<<<2048, 256>>>(d.dy[i], R * H, seed + 11 + i, 1.0f);
  }
  d.gu = DevAlloc<bf16>(R * 2 * F);
  d.gu_seed = seed + 15;
  FillGateUp(d, /*outliers=*/false);
  d.w_gu = DevAlloc<bf16>(E * H * 2 * F);
  FillRandom<<<4096, 256>>>(d.w_gu, E * H * 2 * F, seed + 21, 2.0f / std::sqrt(float(2 * F)));
  d.w_d = DevAlloc<bf16>(E * F * H);
  FillRandom<<<4096, 256>>>(d.w_d, E * F * H, seed + 31, 2.0f / std::sqrt(float(H)));
  d.w_gu_kn = DevAlloc<bf16>(E * H * 2 * F);
  TransposeLast2<<<4096, 256>>>(d.w_gu, d.w_gu_kn, E, H, 2 * F);
  d.w_d_kn = DevAlloc<bf16>(E * F * H);
  TransposeLast2<<<4096, 256>>>(d.w_d, d.w_d_kn, E, F, H);
  d.dgu = DevAlloc<bf16>(R * 2 * F);
  d.dh = DevAlloc<bf16>(R * F);
  d.dx = DevAlloc<bf16>(R * H);
  d.offsets = DevCopy(p.offsets);
  d.dest_row = DevCopy(p.dest_row);
  int64_t mbs = 0;
  for (int x = 0; x < p.e; ++x) mbs += (p.offsets[x + 1] - p.offsets[x] + 127) / 128;
  d.mb_done = DevAlloc<int>(mbs + 1);
  CK(cudaMemset(d.mb_done, 0, (mbs + 1) * sizeof(int)));
  d.epoch = 0;
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return d;
}

static void Free(DgradProblem& d) {
  for (void* q : {(void*)d.dy[0], (void*)d.dy[1], (void*)d.gu, (void*)d.w_gu, (void*)d.w_d,
                  (void*)d.w_gu_kn, (void*)d.w_d_kn, (void*)d.dgu, (void*)d.dh, (void*)d.dx,
                  (void*)d.offsets, (void*)d.dest_row, (void*)d.mb_done})
    CK(cudaFree(q));
}

// mode: 1 dh tiles only, 2 dx tiles only (on the dgate_up already there), 3 both, one launch.
// n_major: RunArgs::n_major (bit 0 the dh tiles, bit 1 the dx tiles N-block-major per expert).
static void Launch(DgradProblem& d, int mode, int dyi, bool keep_dh, cudaStream_t s,
                   int n_major = 0) {
  const Problem& p = *d.p;
  const int64_t H = p.h, F = p.f, E = p.e, R = d.rows + kPadRows;
  Params prm;
  memset(&prm, 0, sizeof(prm));
  GemmOperands& dh = prm.op[kDgradDh];
  CheckStr(MakeRowMajorTensorMap(&dh.a_map, d.dy[dyi], R, H, H, 64, 128));
  CheckStr(MakeRowMajorTensorMap(&dh.b_map, d.w_d, E * F, H, H, 64, 128));  // [E * F, H]
  dh.n = int(F);
  dh.k = int(H);
  dh.a_load = int32_t(ALoad::kTmaBlock);
  GemmOperands& dx = prm.op[kDgradDx];
  CheckStr(MakeRowMajorTensorMap(&dx.a_map, d.dgu, R, 2 * F, 2 * F, 64, 128));
  CheckStr(MakeRowMajorTensorMap(&dx.b_map, d.w_gu, E * H, 2 * F, 2 * F, 64, 128));  // [E*H, 2F]
  dx.n = int(H);
  dx.k = int(2 * F);
  dx.a_load = int32_t(ALoad::kTmaBlock);
  prm.f = int(F);
  prm.fwd_gate_up = d.gu;
  prm.dgate_up = d.dgu;
  prm.l2_copy = keep_dh ? d.dh : nullptr;
  prm.l2_copy_ld = F;
  prm.l2_dest = IndexedRowDest{d.dx, d.dest_row, H};
  RunArgs a;
  a.offsets = d.offsets;
  a.num_experts = p.e;
  a.mode = mode;
  a.nb1 = int(F / 256);
  a.nb2 = int(H / 256);
  a.n_major = n_major;
  a.hooks.mb_done = mode == 3 ? d.mb_done : nullptr;
  a.hooks.target = (d.epoch + 1) * a.nb1;
  static int sms = 0;
  if (sms == 0) CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (g_cluster) {  // one kind per launch: mode 3 = dh, then dx
    a.hooks.mb_done = nullptr;
    LaunchClusterPairs<ClusterEngine>(prm, a, sms, s);
    return;
  }
  static bool attr = false;
  if (!attr) {
    CK(cudaFuncSetAttribute(MoeCoreKernel<DgradEngine>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                            int(sizeof(KernelStorage<DgradEngine>))));
    attr = true;
  }
  MoeCoreKernel<DgradEngine>
      <<<sms, DgradEngine::kThreads, sizeof(KernelStorage<DgradEngine>), s>>>(prm, a);
  CK(cudaGetLastError());
  if (mode == 3) ++d.epoch;
}

static void Poison(DgradProblem& d) {
  const int64_t R = d.rows + kPadRows, H = d.p->h, F = d.p->f;
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.dgu), R * 2 * F, kPoison);
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.dh), R * F, kPoison);
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.dx), R * H, kPoison);
  CK(cudaGetLastError());
}

static CheckResult Check(DgradProblem& d, const std::vector<int32_t>& samples) {
  const Problem& p = *d.p;
  const int64_t H = p.h, F = p.f, R = d.rows;
  CheckResult res;
  char buf[512];
  // 1. dgate_up bit for bit against backend cuda's SwigluBackward on the kernel's own dh.
  bf16* ref_dgu = DevAlloc<bf16>((R + kPadRows) * 2 * F);
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(ref_dgu), (R + kPadRows) * 2 * F, kPoison);
  CheckStr(megamoe::grouped::SwigluBackward(d.dh, d.gu, ref_dgu, R, F, d.offsets, p.e, 0));
  unsigned long long* cnt = DevAlloc<unsigned long long>(8);
  CK(cudaMemset(cnt, 0, 8 * sizeof(unsigned long long)));
  CountDiff<<<1024, 256>>>(reinterpret_cast<const uint32_t*>(ref_dgu),
                           reinterpret_cast<const uint32_t*>(d.dgu), (R + kPadRows) * F, cnt + 0);
  // 2. dh and dx against fp32 references on the sampled rows.
  const int ns = int(samples.size());
  std::vector<int32_t> s_expert(ns), s_dest(ns);
  for (int i = 0; i < ns; ++i) {
    s_expert[i] = int32_t(std::upper_bound(p.offsets.begin(), p.offsets.end(), samples[i]) -
                          p.offsets.begin() - 1);
    s_dest[i] = p.dest_row[samples[i]];
  }
  int32_t* d_samples = DevCopy(samples);
  int32_t* d_expert = DevCopy(s_expert);
  int32_t* d_dest = DevCopy(s_dest);
  ErrAcc* acc = DevAlloc<ErrAcc>(2);
  CK(cudaMemset(acc, 0, 2 * sizeof(ErrAcc)));
  float* ref_dh = DevAlloc<float>(int64_t(ns) * F);
  RefRowGemm<<<std::max(ns, 1), 256, H * sizeof(float)>>>(d.dy[0], H, d_samples, d_expert,
                                                          d.w_d_kn, H, F, ref_dh);
  CompareRows<<<std::max(std::min(ns, 1024), 1), 256>>>(d.dh, F, d_samples, ref_dh, F, ns, acc);
  float* ref_dx = DevAlloc<float>(int64_t(ns) * H);
  RefRowGemm<<<std::max(ns, 1), 256, 2 * F * sizeof(float)>>>(d.dgu, 2 * F, d_samples, d_expert,
                                                              d.w_gu_kn, 2 * F, H, ref_dx);
  CompareRows<<<std::max(std::min(ns, 1024), 1), 256>>>(d.dx, H, d_dest, ref_dx, H, ns, acc + 1);
  // 3. Every row written, pad rows untouched.
  CountEq<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.dgu), 0, R, 2 * F, kPoison, cnt + 1);
  CountEq<<<64, 256>>>(reinterpret_cast<uint16_t*>(d.dgu), R, R + kPadRows, 2 * F, kPoison,
                       cnt + 2);
  CountEq<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.dx), 0, R, H, kPoison, cnt + 3);
  CountEq<<<64, 256>>>(reinterpret_cast<uint16_t*>(d.dx), R, R + kPadRows, H, kPoison, cnt + 4);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  ErrAcc e[2];
  unsigned long long c[8];
  CK(cudaMemcpy(e, acc, sizeof(e), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(c, cnt, sizeof(c), cudaMemcpyDeviceToHost));
  snprintf(buf, sizeof(buf), " dgate_up vs cuda SwigluBackward: %llu words differ;", c[0]);
  res.msg += buf;
  if (c[0] != 0) res.ok = false;
  const char* names[2] = {"dh", "dx"};
  for (int i = 0; i < 2; ++i) {
    const double rel = RelErr(e[i]);
    snprintf(buf, sizeof(buf), " %s rel=%.2e maxabs=%.2e(of %.2e) n=%llu nan=%llu;", names[i],
             rel, e[i].max_abs, e[i].max_ref, e[i].count, e[i].nan);
    res.msg += buf;
    if (!(rel < 1e-2) || e[i].nan != 0 || (ns > 0 && e[i].count == 0)) res.ok = false;
  }
  const unsigned long long pad_g = uint64_t(kPadRows) * 2 * F, pad_x = uint64_t(kPadRows) * H;
  snprintf(buf, sizeof(buf),
           " dgate_up unwritten=%llu pad-overwritten=%llu; dx unwritten=%llu pad-overwritten=%llu;",
           c[1], pad_g - c[2], c[3], pad_x - c[4]);
  res.msg += buf;
  if (c[1] != 0 || c[2] != pad_g || c[3] != 0 || c[4] != pad_x) res.ok = false;
  for (void* q : {(void*)ref_dgu, (void*)cnt, (void*)d_samples, (void*)d_expert, (void*)d_dest,
                  (void*)acc, (void*)ref_dh, (void*)ref_dx})
    CK(cudaFree(q));
  return res;
}

// Bitwise run to run: the one launch again on the same inputs, dgate_up and dx compared.
static unsigned long long RerunDiff(DgradProblem& d) {
  const int64_t R = d.rows + kPadRows, H = d.p->h, F = d.p->f;
  const int64_t n_g = R * F, n_x = R * H / 2;  // u32 words
  uint32_t* copy = DevAlloc<uint32_t>(n_g + n_x);
  CK(cudaMemcpy(copy, d.dgu, n_g * 4, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(copy + n_g, d.dx, n_x * 4, cudaMemcpyDeviceToDevice));
  Poison(d);
  Launch(d, 3, 0, false, 0);
  unsigned long long* cnt = DevAlloc<unsigned long long>(1);
  CK(cudaMemset(cnt, 0, 8));
  CountDiff<<<1024, 256>>>(copy, reinterpret_cast<uint32_t*>(d.dgu), n_g, cnt);
  CountDiff<<<1024, 256>>>(copy + n_g, reinterpret_cast<uint32_t*>(d.dx), n_x, cnt);
  unsigned long long c = 0;
  CK(cudaMemcpy(&c, cnt, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(copy));
  CK(cudaFree(cnt));
  return c;
}

static double TimeMode(DgradProblem& d, int mode, int iters, int n_major = 0) {
  return TimeLaunches([&](int i) { Launch(d, mode, i & 1, false, 0, n_major); }, iters, 0);
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  bool quick = false, no_check = false;
  int iters = 15, only_problem = -1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--nocheck")) no_check = true;
    if (!strcmp(argv[i], "--problem") && i + 1 < argc) only_problem = atoi(argv[++i]);
    if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
    if (!strcmp(argv[i], "--cluster")) g_cluster = true;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs; engine %s: %zu bytes of shared memory\n", prop.name,
         prop.multiProcessorCount, g_cluster ? "S4-dgrad-cluster2 (B multicast)" : "S4-dgrad",
         g_cluster ? sizeof(ClusterStorage<ClusterEngine>) : sizeof(KernelStorage<DgradEngine>));
  int failures = 0;
  failures += !RunFastPathTest("swiglu-backward fast path vs SwigluGrad()", SwigluGradExactTest,
                               65536 * 16);
  std::vector<Problem> problems = StandardProblems(quick, /*skewed_235b=*/false);
  std::vector<std::string> table;
  for (size_t pi = 0; pi < problems.size(); ++pi) {
    if (only_problem >= 0 && int(pi) != only_problem) continue;
    Problem& p = problems[pi];
    FinishProblem(p, 100 + pi);
    printf("\n=== %s: E=%d H=%d F=%d rows=%lld\n", p.name.c_str(), p.e, p.h, p.f,
           (long long)p.rows());
    DgradProblem d = Upload(p, 2000 + pi);
    if (!no_check) {
      FillGateUp(d, /*outliers=*/true);
      Poison(d);
      Launch(d, 3, 0, true, 0);
      SyncOrDie("the dgrad launch");
      CheckResult r = Check(d, Samples(p));
      const unsigned long long diff = RerunDiff(d);
      if (diff != 0) r.ok = false;
      printf("[S4-dgrad] one launch %s:%s rerun-diff-words=%llu\n", r.ok ? "PASS" : "FAIL",
             r.msg.c_str(), diff);
      failures += !r.ok;
      FillGateUp(d, /*outliers=*/false);  // timed without them, as a layer's data
    }
    if (p.rows() >= 100000) {
      const double fl = 2.0 * p.rows() * p.h * p.f * 3;  // dh (F) + dx (2F)
      const double t3 = TimeMode(d, 3, iters), t1 = TimeMode(d, 1, iters),
                   t2 = TimeMode(d, 2, iters);
      char line[256];
      snprintf(line, sizeof(line),
               "%-14s dgrad one launch %7.3f ms %6.1f TFLOP/s | dh+SwiGLU-bwd alone %7.3f ms "
               "%6.1f | dx alone %7.3f ms %6.1f",
               p.name.c_str(), t3, fl / t3 * 1e-9, t1, fl / 3 / t1 * 1e-9, t2,
               fl * 2 / 3 / t2 * 1e-9);
      printf("%s\n", line);
      table.push_back(line);
      // N-block-major orders inside an expert (the forward's order for weight slices over
      // 16 MiB, ffi/heuristics/fused_tile_order.h): the dh tiles (alone), the dx tiles (alone),
      // and each in the one launch.
      const double dh_n = TimeMode(d, 1, iters, 1), dx_n = TimeMode(d, 2, iters, 2);
      snprintf(line, sizeof(line),
               "%-14s N-major: dh+SwiGLU-bwd alone %7.3f ms %6.1f | dx alone %7.3f ms %6.1f",
               p.name.c_str(), dh_n, fl / 3 / dh_n * 1e-9, dx_n, fl * 2 / 3 / dx_n * 1e-9);
      printf("%s\n", line);
      table.push_back(line);
      for (int order : {1, 2, 3}) {
        const double ms = TimeMode(d, 3, iters, order);
        snprintf(line, sizeof(line), "%-14s dgrad one launch, %-13s N-major %7.3f ms %6.1f TFLOP/s",
                 p.name.c_str(), order == 1 ? "dh" : order == 2 ? "dx" : "dh and dx", ms,
                 fl / ms * 1e-9);
        printf("%s\n", line);
        table.push_back(line);
      }
    }
    Free(d);
  }
  printf("\n==== summary (median of %d, grid %d) ====\n", iters, prop.multiProcessorCount);
  for (auto& l : table) printf("%s\n", l.c_str());
  printf("failures: %d\n", failures);
  return failures == 0 ? 0 : 1;
}
