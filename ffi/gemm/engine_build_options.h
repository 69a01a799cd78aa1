// The tile engine's build options and their defaults, in one place: the kernels read them, and
// so does build_info() (ffi/module.cc), so that what it reports is what the kernels were built
// with. Each is set by CMake (JAX_MEGAMOE_<NAME>=ON/OFF) or Bazel (--define=megamoe_<name>=1/0);
// see ffi/gemm/sm90_moe_tile_engine.cuh for what each does.
#pragma once

// The fused kernel's cycle accounting (ffi/gemm/sm90_engine_profile.cuh): benchmarks only.
#ifndef MEGAMOE_ENGINE_PROFILE
#define MEGAMOE_ENGINE_PROFILE 0
#endif

// A bf16 L2 tile's epilogue, half of it, during the next tile's mainloop (Sm90MoeTileEngine::
// kDeferL2Epilogue). Off: it slowed the 235B forward 9-14% on an H100, where L2 is
// memory-bound, and did not speed up 30B's (FUSED_CORE_NOTES, session 33).
#ifndef MEGAMOE_DEFER_L2_EPILOGUE
#define MEGAMOE_DEFER_L2_EPILOGUE 0
#endif

// The same for a bf16 L1 tile without the gate_up residual: half its h columns, with their
// SwiGLU, during the next tile's mainloop (kDeferL1Epilogue). On since session 33: the 30B
// forward 3.4% faster on an H100, 235B unchanged, the outputs bit for bit the same.
#ifndef MEGAMOE_DEFER_L1_EPILOGUE
#define MEGAMOE_DEFER_L1_EPILOGUE 1
#endif

// With the L1 epilogue deferred: the parts each of its two pending h groups is split into, one
// a stage (2: half a group's SwiGLU; 4: a quarter, spread over eight stages; 1: a whole
// group's). Benchmarks (harness build fused_core_bench_l1x4), not yet measured beyond 2.
#ifndef MEGAMOE_DEFER_L1_PARTS_PER_GROUP
#define MEGAMOE_DEFER_L1_PARTS_PER_GROUP 2
#endif

