// Standalone harness for the GEMM core of the fused MoE forward (ffi/gemm/sm90_moe_tile_engine.cuh):
// L1 (x @ w_gate_up + SwiGLU) and L2 (h @ w_down -> per-row destinations) over grouped problems,
// A rows gathered by index (per-row TMA, cp.async) or contiguous (one TMA box), checked against a
// simple fp32-accumulating GPU reference with poisoned outputs, bitwise run-to-run, and timed with
// CUDA events (median after warm-up, rotating inputs). CUDA C++ only, no JAX. Each check prints
// digests of its outputs, to compare two builds bit for bit.
// Engine "S4-BK" reads B K-major (Sm90MoeTileEngine<..., kBKMajor>: the weights transposed to
// [E, N, K] on the device, as the fused backward's dgrad GEMMs read W^T), same checks.
//
// Build: benchmarks/kernels/build_fused_core_bench.sh. Run: ./fused_core_bench [--quick]
//   [--engine I] (0 S4, 1 S3, 2 S4-BK, 3 S4-BK-C2: S4-BK with 2-CTA clusters sharing B, one GEMM
//   per launch, experimental).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "benchmarks/kernels/engine_profile_report.h"
#include "benchmarks/kernels/harness_core.cuh"
#include "ffi/gemm/sm90_tensor_maps.cuh"

// ------------------------------------------------------------------ forward-only helpers
__global__ void GatherRows(const bf16* x, const int32_t* row_token, bf16* xs, int64_t rows,
                           int64_t h) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(x + int64_t(row_token[r]) * h);
    uint4* d = reinterpret_cast<uint4*>(xs + r * h);
    for (int64_t i = threadIdx.x; i < h / 8; i += blockDim.x) d[i] = s[i];
  }
}

// Compares got[got_row[s], col0 + j] (bf16, row stride ldg) with ref[s, j] (fp32, ncols);
// mode 1: ref is gate_up [s, 2F] and got is h: ref_h = swiglu(bf16(g), bf16(u)).
__global__ void Compare(const bf16* got, int64_t ldg, const int32_t* got_row, int64_t col0,
                        const float* ref, int64_t ref_ld, int64_t ncols, int swiglu_f,
                        int num_samples, ErrAcc* acc) {
  ErrSums sums;
  for (int s = blockIdx.x; s < num_samples; s += gridDim.x) {
    for (int64_t j = threadIdx.x; j < ncols; j += blockDim.x) {
      float rv;
      if (swiglu_f > 0) {
        const float g = __bfloat162float(__float2bfloat16(ref[s * ref_ld + j]));
        const float u = __bfloat162float(__float2bfloat16(ref[s * ref_ld + swiglu_f + j]));
        rv = megamoe::grouped::Swiglu(g, u);
      } else {
        rv = ref[s * ref_ld + j];
      }
      sums.add(__bfloat162float(got[int64_t(got_row[s]) * ldg + col0 + j]), rv);
    }
  }
  sums.flush(acc);
}

// The engine's branch-free SwiGLU against megamoe::grouped::Swiglu: every bf16 value of the
// gate (the epilogue rounds gate/up to bf16 first) times a few up values, fp32 bits compared.
__global__ void SwigluExactTest(unsigned long long* mismatch, unsigned long long* slow_count) {
  const float ups[8] = {1.0f, -1.0f, 3.25f, -0.0078125f, 1e-30f, 65504.0f, 0.0f, -7.5f};
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536 * 8) return;
  const uint16_t gb = uint16_t(i & 0xffff);
  const float g = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&gb));
  const float u = ups[i >> 16];
  bool slow = false;
  const float a = detail::swiglu_fast_path(g, u, slow);
  const float b = megamoe::grouped::Swiglu(g, u);
  if (slow) {
    atomicAdd(slow_count, 1ull);
  } else if (__float_as_uint(a) != __float_as_uint(b) && !(isnan(a) && isnan(b))) {
    atomicAdd(mismatch, 1ull);
  }
}

struct DeviceProblem {
  const Problem* p;
  int64_t rows;
  bf16 *x[2], *xs, *w_gu, *w_d, *h, *gu, *out;
  bf16 *w_gu_t, *w_d_t;  // the weights K-major, [E, 2F, H] and [E, H, F] (engine S4-BK)
  int32_t *offsets, *row_token, *dest_row;
  int* mb_done;
  int epoch;
};

static DeviceProblem Upload(const Problem& p, uint64_t seed) {
  DeviceProblem d{};
  d.p = &p;
  d.rows = p.rows();
  const int64_t H = p.h, F = p.f, E = p.e, T = p.t, R = d.rows + kPadRows;
  for (int i = 0; i < 2; ++i) {
    d.x[i] = DevAlloc<bf16>(T * H);
    FillRandom<<<1024, 256>>>(d.x[i], T * H, seed + 11 + i, 1.0f);
  }
  d.w_gu = DevAlloc<bf16>(E * H * 2 * F);
  FillRandom<<<4096, 256>>>(d.w_gu, E * H * 2 * F, seed + 21, 2.0f / std::sqrt(float(H)));
  d.w_d = DevAlloc<bf16>(E * F * H);
  FillRandom<<<4096, 256>>>(d.w_d, E * F * H, seed + 31, 2.0f / std::sqrt(float(F)));
  d.w_gu_t = DevAlloc<bf16>(E * H * 2 * F);
  TransposeLast2<<<4096, 256>>>(d.w_gu, d.w_gu_t, E, H, 2 * F);
  d.w_d_t = DevAlloc<bf16>(E * F * H);
  TransposeLast2<<<4096, 256>>>(d.w_d, d.w_d_t, E, F, H);
  d.xs = DevAlloc<bf16>(R * H);
  d.h = DevAlloc<bf16>(R * F);
  d.gu = DevAlloc<bf16>(R * 2 * F);
  d.out = DevAlloc<bf16>(R * H);
  d.offsets = DevCopy(p.offsets);
  d.row_token = DevCopy(p.row_token);
  d.dest_row = DevCopy(p.dest_row);
  int64_t mbs = 0;
  for (int x = 0; x < p.e; ++x) mbs += (p.offsets[x + 1] - p.offsets[x] + 127) / 128;
  d.mb_done = DevAlloc<int>(mbs + 1);
  CK(cudaMemset(d.mb_done, 0, (mbs + 1) * sizeof(int)));
  d.epoch = 0;
  if (d.rows > 0) GatherRows<<<2048, 256>>>(d.x[0], d.row_token, d.xs, d.rows, H);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return d;
}

static void Free(DeviceProblem& d) {
  for (void* q : {(void*)d.x[0], (void*)d.x[1], (void*)d.xs, (void*)d.w_gu, (void*)d.w_d,
                  (void*)d.w_gu_t, (void*)d.w_d_t, (void*)d.h, (void*)d.gu, (void*)d.out, (void*)d.offsets, (void*)d.row_token,
                  (void*)d.dest_row, (void*)d.mb_done})
    CK(cudaFree(q));
}

struct Variant {
  const char* name;
  int mode;      // 1 L1, 2 L2, 3 both
  ALoad l1_load;
  bool gate_up;  // L1 also stores gate_up
  int n_major = 0;        // tile order inside an expert: bit 0 L1, bit 1 L2 N-block-major
  bool raw_gate = false;  // benchmark only: no SwiGLU math (not checked)
  // Benchmark only (not checked): EngineParams::bench_skip_epilogue. 1 no epilogue (mainloop
  // rate), 2 the epilogue without its global stores, 3 the staging only, 4 as 1 with the row
  // destinations looked up.
  int skip_epi = 0;
  // L2's rows contiguous at their group rows (identity destinations), stored by TMA boxes
  // (EngineParams::l2_rows), as the fused forward does with one rank alone.
  bool l2_tma = false;
};

struct Launcher {
  virtual ~Launcher() = default;
  virtual const char* name() const = 0;
  virtual size_t smem() const = 0;
  virtual bool b_kmajor() const = 0;
  virtual void launch(const Params& p, const RunArgs& a, int grid, cudaStream_t s) = 0;
  virtual bool supports(const Variant&) const { return true; }
};

// Engine "S4-BK-C2": K-major B shared by 2-CTA clusters (kClusterM = 2, experimental), one GEMM
// per launch (no one-launch L1+L2) with A rows contiguous.
template <class Engine>
struct ClusterLauncher : Launcher {
  const char* nm;
  explicit ClusterLauncher(const char* n) : nm(n) {}
  const char* name() const override { return nm; }
  size_t smem() const override { return sizeof(ClusterStorage<Engine>); }
  bool b_kmajor() const override { return true; }
  bool supports(const Variant& v) const override {
    return v.mode != 3 && v.l1_load == ALoad::kTmaBlock;
  }
  void launch(const Params& p, const RunArgs& a, int grid, cudaStream_t s) override {
    LaunchClusterPairs<Engine>(p, a, grid, s);
  }
};

template <class Engine, bool kBKMajor = false>
struct EngineLauncher : Launcher {
  const char* nm;
  bool b_kmajor() const override { return kBKMajor; }
  explicit EngineLauncher(const char* n) : nm(n) {
    CK(cudaFuncSetAttribute(MoeCoreKernel<Engine>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            int(smem())));
  }
  const char* name() const override { return nm; }
  size_t smem() const override { return sizeof(KernelStorage<Engine>); }
  void launch(const Params& p, const RunArgs& a, int grid, cudaStream_t s) override {
    MoeCoreKernel<Engine><<<grid, Engine::kThreads, smem(), s>>>(p, a);
  }
};

static Params MakeParams(DeviceProblem& d, const Variant& v, int xi, bool b_kmajor) {
  const Problem& p = *d.p;
  const int64_t H = p.h, F = p.f, E = p.e, R = d.rows + kPadRows;
  Params prm;
  memset(&prm, 0, sizeof(prm));
  GemmOperands& l1 = prm.op[kL1GateUp];
  if (v.l1_load == ALoad::kTmaBlock) {
    CheckStr(MakeRowMajorTensorMap(&l1.a_map, d.xs, R, H, H, 64, 128));
  } else {
    CheckStr(MakeRowMajorTensorMap(&l1.a_map, d.x[xi], p.t, H, H, 64, 1));
  }
  if (b_kmajor) {
    CheckStr(MakeRowMajorTensorMap(&l1.b_map, d.w_gu_t, E * 2 * F, H, H, 64, 128));
  } else {
    CheckStr(MakeRowMajorTensorMap(&l1.b_map, d.w_gu, E * H, 2 * F, 2 * F, 64, 64));
  }
  l1.n = int(2 * F);
  l1.a_ptr = d.x[xi];
  l1.lda = H;
  l1.row_index = d.row_token;
  l1.k = int(H);
  l1.a_load = int32_t(v.l1_load);
  GemmOperands& l2 = prm.op[kL2Down];
  CheckStr(MakeRowMajorTensorMap(&l2.a_map, d.h, R, F, F, 64, 128));
  if (b_kmajor) {
    CheckStr(MakeRowMajorTensorMap(&l2.b_map, d.w_d_t, E * H, F, F, 64, 128));
  } else {
    CheckStr(MakeRowMajorTensorMap(&l2.b_map, d.w_d, E * F, H, H, 64, 64));
  }
  l2.n = int(H);
  l2.k = int(F);
  l2.a_load = int32_t(ALoad::kTmaBlock);
  prm.h = d.h;
  prm.gate_up = v.gate_up ? d.gu : nullptr;
  if (v.gate_up) CheckStr(MakeRowMajorTensorMap(&prm.gate_up_map, d.gu, R, 2 * F, 2 * F, 64, 64));
  prm.f = int(F);
  prm.l1_raw_gate = v.raw_gate ? 1 : 0;
  prm.bench_skip_epilogue = v.skip_epi;
  prm.l2_dest = IndexedRowDest{d.out, d.dest_row, H};
  if (v.l2_tma) {
    prm.l2_rows = d.out;
    prm.l2_rows_ld = H;
    CheckStr(MakeRowMajorTensorMap(&prm.l2_rows_map, d.out, R, H, H, 64, 64));
  }
  return prm;
}

static RunArgs MakeArgs(DeviceProblem& d, const Variant& v) {
  RunArgs a;
  a.offsets = d.offsets;
  a.num_experts = d.p->e;
  a.mode = v.mode;
  a.nb1 = d.p->f / 128;
  a.nb2 = d.p->h / 256;
  a.n_major = v.n_major;
  a.hooks.mb_done = v.mode == 3 ? d.mb_done : nullptr;
  a.hooks.target = (d.epoch + 1) * a.nb1;
  return a;
}

static int g_sms = 0;

static void Launch(Launcher& L, DeviceProblem& d, const Variant& v, const Params& prm,
                   cudaStream_t s, int grid = 0) {
  RunArgs a = MakeArgs(d, v);
  L.launch(prm, a, grid > 0 ? grid : g_sms, s);
  CK(cudaGetLastError());
  if (v.mode == 3) ++d.epoch;
}

static void RunOnce(Launcher& L, DeviceProblem& d, const Variant& v, int xi, cudaStream_t s) {
  Params prm = MakeParams(d, v, xi, L.b_kmajor());
  Launch(L, d, v, prm, s);
}

// Reference for the sampled rows, compared with the kernel's outputs.
static CheckResult Check(DeviceProblem& d, const Variant& v, int xi,
                         const std::vector<int32_t>& samples) {
  const Problem& p = *d.p;
  CheckResult res;
  const int64_t H = p.h, F = p.f, R = d.rows;
  const int ns = int(samples.size());
  std::vector<int32_t> s_expert(ns), s_token(ns), s_dest(ns);
  for (int i = 0; i < ns; ++i) {
    const int r = samples[i];
    s_expert[i] = int32_t(std::upper_bound(p.offsets.begin(), p.offsets.end(), r) -
                          p.offsets.begin() - 1);
    s_token[i] = p.row_token[r];
    s_dest[i] = v.l2_tma ? r : p.dest_row[r];
  }
  int32_t* d_samples = DevCopy(samples);
  int32_t* d_expert = DevCopy(s_expert);
  int32_t* d_token = DevCopy(s_token);
  int32_t* d_dest = DevCopy(s_dest);
  ErrAcc* acc = DevAlloc<ErrAcc>(4);
  unsigned long long* cnt = DevAlloc<unsigned long long>(8);
  CK(cudaMemset(acc, 0, 4 * sizeof(ErrAcc)));
  CK(cudaMemset(cnt, 0, 8 * sizeof(unsigned long long)));
  char buf[512];
  if (v.mode & 1) {
    float* ref = DevAlloc<float>(int64_t(ns) * 2 * F);
    RefRowGemm<<<ns, 256, H * sizeof(float)>>>(d.x[xi], H, d_token, d_expert, d.w_gu, H, 2 * F,
                                              ref);
    Compare<<<std::min(ns, 1024), 256>>>(d.h, F, d_samples, 0, ref, 2 * F, F, int(F), ns, acc + 0);
    if (v.gate_up)
      Compare<<<std::min(ns, 1024), 256>>>(d.gu, 2 * F, d_samples, 0, ref, 2 * F, 2 * F, 0, ns,
                                           acc + 1);
    CountEq<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.h), 0, R, F, kPoison, cnt + 0);
    CountEq<<<64, 256>>>(reinterpret_cast<uint16_t*>(d.h), R, R + kPadRows, F, kPoison, cnt + 1);
    if (v.gate_up) {
      CountEq<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.gu), 0, R, 2 * F, kPoison, cnt + 2);
      CountEq<<<64, 256>>>(reinterpret_cast<uint16_t*>(d.gu), R, R + kPadRows, 2 * F, kPoison,
                           cnt + 3);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaFree(ref));
  }
  if (v.mode & 2) {
    float* ref = DevAlloc<float>(int64_t(ns) * H);
    // L2 reference from the kernel's own h (so L2 is checked on its own).
    RefRowGemm<<<ns, 256, F * sizeof(float)>>>(d.h, F, d_samples, d_expert, d.w_d, F, H, ref);
    Compare<<<std::min(ns, 1024), 256>>>(d.out, H, d_dest, 0, ref, H, H, 0, ns, acc + 2);
    CountEq<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.out), 0, R, H, kPoison, cnt + 4);
    CountEq<<<64, 256>>>(reinterpret_cast<uint16_t*>(d.out), R, R + kPadRows, H, kPoison,
                         cnt + 5);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaFree(ref));
  }
  ErrAcc e[4];
  unsigned long long c[8];
  CK(cudaMemcpy(e, acc, sizeof(e), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(c, cnt, sizeof(c), cudaMemcpyDeviceToHost));
  std::string m;
  auto add = [&](const char* what, const ErrAcc& x) {
    const double rel = RelErr(x);
    snprintf(buf, sizeof(buf), " %s rel=%.2e maxabs=%.2e(of %.2e) n=%llu nan=%llu;", what, rel,
             x.max_abs, x.max_ref, x.count, x.nan);
    m += buf;
    if (!(rel < 1e-2) || x.nan != 0 || (ns > 0 && x.count == 0)) res.ok = false;
  };
  if (v.mode & 1) {
    add("h", e[0]);
    if (v.gate_up) add("gate_up", e[1]);
    const unsigned long long pad_h = uint64_t(kPadRows) * F;
    snprintf(buf, sizeof(buf), " h unwritten=%llu pad-overwritten=%llu;", c[0], pad_h - c[1]);
    m += buf;
    if (c[0] != 0 || c[1] != pad_h) res.ok = false;
    if (v.gate_up) {
      const unsigned long long pad_g = uint64_t(kPadRows) * 2 * F;
      snprintf(buf, sizeof(buf), " gu unwritten=%llu pad-overwritten=%llu;", c[2], pad_g - c[3]);
      m += buf;
      if (c[2] != 0 || c[3] != pad_g) res.ok = false;
    }
  }
  if (v.mode & 2) {
    add("y", e[2]);
    const unsigned long long pad_y = uint64_t(kPadRows) * H;
    snprintf(buf, sizeof(buf), " y unwritten=%llu pad-overwritten=%llu;", c[4], pad_y - c[5]);
    m += buf;
    if (c[4] != 0 || c[5] != pad_y) res.ok = false;
  }
  res.msg = m;
  for (void* q : {(void*)d_samples, (void*)d_expert, (void*)d_token, (void*)d_dest, (void*)acc,
                  (void*)cnt})
    CK(cudaFree(q));
  return res;
}

static void Poison(DeviceProblem& d) {
  const int64_t R = d.rows + kPadRows, H = d.p->h, F = d.p->f;
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.h), R * F, kPoison);
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.gu), R * 2 * F, kPoison);
  FillU16<<<2048, 256>>>(reinterpret_cast<uint16_t*>(d.out), R * H, kPoison);
  CK(cudaGetLastError());
}

// Bitwise run-to-run: run again (same inputs), compare the outputs word by word.
static unsigned long long RerunDiff(Launcher& L, DeviceProblem& d, const Variant& v, int xi) {
  const int64_t R = d.rows + kPadRows, H = d.p->h, F = d.p->f;
  const int64_t n_h = R * F / 2, n_g = R * F, n_y = R * H / 2;  // u32 words
  uint32_t* copy = DevAlloc<uint32_t>(n_h + n_g + n_y);
  CK(cudaMemcpy(copy, d.h, n_h * 4, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(copy + n_h, d.gu, n_g * 4, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(copy + n_h + n_g, d.out, n_y * 4, cudaMemcpyDeviceToDevice));
  Poison(d);
  if (v.mode == 2) CK(cudaMemcpy(d.h, copy, n_h * 4, cudaMemcpyDeviceToDevice));  // L2 input
  RunOnce(L, d, v, xi, 0);
  CK(cudaDeviceSynchronize());
  unsigned long long* cnt = DevAlloc<unsigned long long>(1);
  CK(cudaMemset(cnt, 0, 8));
  if (v.mode & 1) {
    CountDiff<<<1024, 256>>>(copy, reinterpret_cast<uint32_t*>(d.h), n_h, cnt);
    if (v.gate_up) CountDiff<<<1024, 256>>>(copy + n_h, reinterpret_cast<uint32_t*>(d.gu), n_g, cnt);
  }
  if (v.mode & 2)
    CountDiff<<<1024, 256>>>(copy + n_h + n_g, reinterpret_cast<uint32_t*>(d.out), n_y, cnt);
  unsigned long long c = 0;
  CK(cudaMemcpy(&c, cnt, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(copy));
  CK(cudaFree(cnt));
  return c;
}

static double TimeVariant(Launcher& L, DeviceProblem& d, const Variant& v, int iters,
                          int grid = 0) {
  cudaStream_t s = 0;
  const Params prm[2] = {MakeParams(d, v, 0, L.b_kmajor()),
                         MakeParams(d, v, 1, L.b_kmajor())};  // rotate the inputs
  return TimeLaunches([&](int i) { Launch(L, d, v, prm[i & 1], s, grid); }, iters, s);
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  bool quick = false;
  int iters = 15, only_problem = -1, only_engine = -1, only_variant = -1;
  bool no_check = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--problem") && i + 1 < argc) only_problem = atoi(argv[++i]);
    if (!strcmp(argv[i], "--engine") && i + 1 < argc) only_engine = atoi(argv[++i]);
    if (!strcmp(argv[i], "--variant") && i + 1 < argc) only_variant = atoi(argv[++i]);
    if (!strcmp(argv[i], "--nocheck")) no_check = true;
    if (!strcmp(argv[i], "--sms") && i + 1 < argc) g_sms = atoi(argv[++i]);
    if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (g_sms == 0) g_sms = prop.multiProcessorCount;
  printf("device %s, %d SMs, smem/block optin %zu, grid %d\n", prop.name,
         prop.multiProcessorCount, prop.sharedMemPerBlockOptin, g_sms);
  printf("L2 epilogue: %s (MEGAMOE_DEFER_L2_EPILOGUE=%d); L1 epilogue: %s "
         "(MEGAMOE_DEFER_L1_EPILOGUE=%d)\n",
         Sm90MoeTileEngine<4>::kDeferL2Epilogue ? "groups 4-7 deferred to the next mainloop"
                                                : "staged, stored before the next tile",
         MEGAMOE_DEFER_L2_EPILOGUE,
         Sm90MoeTileEngine<4>::kDeferL1Epilogue ? "h groups 2-3 deferred (without gate_up)"
                                                : "staged",
         MEGAMOE_DEFER_L1_EPILOGUE);

  // Engine configurations: <stages, epilogue chunk columns, epilogue buffers>.
  std::vector<Launcher*> engines;
  // Engine configurations: <stages>.
  engines.push_back(new EngineLauncher<Sm90MoeTileEngine<4>>("S4"));
  engines.push_back(new EngineLauncher<Sm90MoeTileEngine<3>>("S3"));
  engines.push_back(
      new EngineLauncher<Sm90MoeTileEngine<4, 4, Bf16Operands, true>, true>("S4-BK"));
  engines.push_back(new ClusterLauncher<Sm90MoeTileEngine<4, 4, Bf16Operands, true, false, 2>>(
      "S4-BK-C2"));
  for (auto* e : engines) printf("engine %s: %zu bytes of shared memory\n", e->name(), e->smem());

  const Variant variants[] = {
      {"L1 contiguous-A (TMA box)", 1, ALoad::kTmaBlock, false},
      {"L1 contiguous-A +gate_up", 1, ALoad::kTmaBlock, true},
      {"L1 contiguous-A, N-major order", 1, ALoad::kTmaBlock, false, 1},
      {"L1 contiguous-A, no SwiGLU (timing)", 1, ALoad::kTmaBlock, false, 0, true},
      {"L1 contiguous-A, mainloop only (timing)", 1, ALoad::kTmaBlock, false, 0, false, 1},
      {"L1 gathered-A (cp.async)", 1, ALoad::kCpAsyncRows, false},
      {"L1 gathered-A (TMA per row)", 1, ALoad::kTmaRows, false},
      {"L2 (per-row destinations)", 2, ALoad::kTmaBlock, false},
      {"L2, N-major order", 2, ALoad::kTmaBlock, false, 2},
      {"L2, mainloop only (timing)", 2, ALoad::kTmaBlock, false, 0, false, 1},
      {"L1+L2 one launch, contiguous-A", 3, ALoad::kTmaBlock, false},
      {"L1+L2 one launch, contiguous-A +gate_up", 3, ALoad::kTmaBlock, true},
      {"L1+L2 one launch, contiguous-A, L1 N-major", 3, ALoad::kTmaBlock, false, 1},
      {"L1+L2 one launch, gathered-A (cp.async)", 3, ALoad::kCpAsyncRows, false},
      // Where L2's epilogue time goes (against "L2, mainloop only"): its math, staging and
      // smem reads without the global stores; the staging alone.
      {"L2, no global stores (timing)", 2, ALoad::kTmaBlock, false, 0, false, 2},
      {"L2, staging only (timing)", 2, ALoad::kTmaBlock, false, 0, false, 3},
      {"L2, mainloop + row destinations looked up (timing)", 2, ALoad::kTmaBlock, false, 0,
       false, 4},
      {"L1 contiguous-A, no global stores (timing)", 1, ALoad::kTmaBlock, false, 0, false, 2},
      {"L1 contiguous-A, staging only (timing)", 1, ALoad::kTmaBlock, false, 0, false, 3},
      // L2's rows by TMA to contiguous destinations (the fused forward at one rank).
      {"L2, rows by TMA (contiguous)", 2, ALoad::kTmaBlock, false, 0, false, 0, true},
      {"L1+L2 one launch, L2 rows by TMA", 3, ALoad::kTmaBlock, false, 0, false, 0, true},
      {"L1+L2 one launch +gate_up, L2 rows by TMA", 3, ALoad::kTmaBlock, true, 0, false, 0, true},
  };
  constexpr int kOneLaunchVariant = 10;  // "L1+L2 one launch, contiguous-A"

  std::vector<Problem> problems = StandardProblems(quick, /*skewed_235b=*/true);
  // Last, so that the indices above stay: F = 128, so L2's K is two stages (the shortest tile;
  // with the deferred L2 epilogue, the pending rows left after such a tile's mainloop).
  problems.push_back(Sized("short K: odd sizes E=16 H=512 F=128", 512, 128,
                           {0, 1, 127, 128, 129, 0, 255, 300, 1, 0, 513, 64, 7, 1000, 0, 2}, 9));
  int failures = 0;
  failures += !RunFastPathTest("swiglu fast path vs Swiglu()", SwigluExactTest, 65536 * 8);
  std::vector<std::string> table;
  for (size_t pi = 0; pi < problems.size(); ++pi) {
    if (only_problem >= 0 && int(pi) != only_problem) continue;
    Problem& p = problems[pi];
    FinishProblem(p, 100 + pi);
    int empty = 0, maxg = 0, ming = 1 << 30;
    for (int x = 0; x < p.e; ++x) {
      const int g = p.offsets[x + 1] - p.offsets[x];
      empty += g == 0;
      maxg = std::max(maxg, g);
      ming = std::min(ming, g);
    }
    printf("\n=== %s: T=%d E=%d H=%d F=%d rows=%lld groups min %d max %d empty %d\n",
           p.name.c_str(), p.t, p.e, p.h, p.f, (long long)p.rows(), ming, maxg, empty);
    DeviceProblem d = Upload(p, 1000 + pi);
    const std::vector<int32_t> samples = Samples(p);
    const bool big = p.rows() >= 100000;
    const double fl1 = 2.0 * p.rows() * p.h * 2.0 * p.f, fl2 = 2.0 * p.rows() * p.f * p.h;
    for (size_t ei = 0; ei < engines.size(); ++ei) {
      if (only_engine >= 0 && int(ei) != only_engine) continue;
      Launcher& L = *engines[ei];
      // Correctness with every engine on the small cases, with the first two on big ones.
      for (size_t vi = 0; vi < sizeof(variants) / sizeof(variants[0]); ++vi) {
        const Variant& v = variants[vi];
        if (only_variant >= 0 && int(vi) != only_variant) continue;
        if (!L.supports(v)) continue;
        const bool do_check = !v.raw_gate && v.skip_epi == 0 && !no_check;
        if (do_check) {
          Poison(d);
          if (v.mode == 2) {
            // L2 alone needs an h: produce it with the contiguous L1 first.
            const Variant l1{"", 1, ALoad::kTmaBlock, false};
            RunOnce(L, d, l1, 0, 0);
          }
          RunOnce(L, d, v, 0, 0);
          CK(cudaDeviceSynchronize());
          CheckResult r = Check(d, v, 0, samples);
          const unsigned long long diff = RerunDiff(L, d, v, 0);
          if (diff != 0) r.ok = false;
          printf("[%s] %-42s %s:%s rerun-diff-words=%llu\n", L.name(), v.name,
                 r.ok ? "PASS" : "FAIL", r.msg.c_str(), diff);
          // The outputs' bits, to compare two builds (e.g. MEGAMOE_DEFER_*_EPILOGUE).
          const size_t row_bytes_h = size_t(d.rows) * p.f * sizeof(bf16);
          printf("    digest h %016llx  gate_up %016llx  y %016llx\n",
                 (unsigned long long)DeviceDigest(d.h, row_bytes_h),
                 (unsigned long long)(v.gate_up ? DeviceDigest(d.gu, 2 * row_bytes_h) : 0),
                 (unsigned long long)(v.mode & 2
                                          ? DeviceDigest(d.out, size_t(d.rows) * p.h * sizeof(bf16))
                                          : 0));
          failures += !r.ok;
        }
        if (big) {
          const double ms = TimeVariant(L, d, v, iters);
          const double fl = v.mode == 1 ? fl1 : v.mode == 2 ? fl2 : fl1 + fl2;
          char line[256];
          snprintf(line, sizeof(line), "%-14s %-8s %-42s %8.3f ms %7.1f TFLOP/s", p.name.c_str(),
                   L.name(), v.name, ms, fl / ms * 1e-9);
          printf("%s\n", line);
          table.push_back(line);
          if (profile::kEnabled) {  // one more launch, its cycle accounting
            RunOnce(L, d, v, 0, 0);
            CK(cudaDeviceSynchronize());
            engine_profile::Report(line, g_sms);
          }
        }
      }
    }
    if (big && pi == 2 && only_variant < 0) {  // 30B uniform: the one-launch L1+L2 on fewer SMs (room for comm CTAs)
      const Variant& v = variants[kOneLaunchVariant];
      for (int grid : {132, 124, 116, 100, 66}) {
        if (grid > prop.multiProcessorCount) continue;
        const double ms = TimeVariant(*engines[0], d, v, iters, grid);
        char line[256];
        snprintf(line, sizeof(line), "%-14s %-10s %-32s grid %3d %8.3f ms %7.1f TFLOP/s",
                 p.name.c_str(), engines[0]->name(), v.name, grid, ms, (fl1 + fl2) / ms * 1e-9);
        printf("%s\n", line);
        table.push_back(line);
      }
    }
    Free(d);
  }
  printf("\n==== summary (median of %d, grid %d) ====\n", iters, g_sms);
  for (auto& l : table) printf("%s\n", l.c_str());
  printf("failures: %d\n", failures);
  return failures == 0 ? 0 : 1;
}
