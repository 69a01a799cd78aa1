// The tile engine's cycle accounting (ffi/gemm/sm90_engine_profile.cuh), read back after one
// launch of a harness built with -DMEGAMOE_ENGINE_PROFILE=1 and printed as one block: where
// each consumer warpgroup's cycles went (the bf16 epilogue by part), the mainloop's cycles per
// stage against the tensor cores' 1,024 (a 128 x 256 x 64 bf16 stage, or 128 x 256 x 128 e4m3, at 4,096 / 8,192 dense
// FLOP per SM cycle), what the producer waited for, and how unevenly the CTAs finished.
#pragma once

#include <algorithm>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "ffi/gemm/sm90_engine_profile.cuh"

namespace engine_profile {

namespace prof = megamoe::fused::sm90::profile;

// Call after a launch of `grid` CTAs has completed. `label` names the run.
inline void Report(const char* label, int grid) {
#if MEGAMOE_ENGINE_PROFILE
  const int n = std::min(grid, prof::kMaxCtas);
  std::vector<unsigned long long> v(size_t(prof::kMaxCtas) * prof::kSlots);
  if (cudaMemcpyFromSymbol(v.data(), prof::g_engine_profile, v.size() * sizeof(v[0])) !=
      cudaSuccess) {
    printf("profile %s: cannot read g_engine_profile\n", label);
    return;
  }
  auto at = [&](int c, int s) { return double(v[size_t(c) * prof::kSlots + s]); };
  // A role's cycles in CTA c from its 32-bit start and end clocks (modulo 2^32).
  auto span = [&](int c, int begin_slot, int end_slot) {
    return double(uint32_t(uint32_t(at(c, end_slot)) - uint32_t(at(c, begin_slot))));
  };
  double begin0 = 1e300, end_max = 0;
  std::vector<double> ends(n);
  for (int c = 0; c < n; ++c) {
    begin0 = std::min(begin0, at(c, prof::kBeginNs));
    ends[c] = std::max({at(c, prof::kProducerEndNs), at(c, prof::kWg0EndNs),
                        at(c, prof::kWg1EndNs)});
    end_max = std::max(end_max, ends[c]);
  }
  std::vector<double> sorted = ends;
  std::sort(sorted.begin(), sorted.end());
  printf("profile %s: %d CTAs, kernel %.3f ms (first start .. last end); CTA ends: first %.3f, "
         "median %.3f, last %.3f ms\n",
         label, n, (end_max - begin0) * 1e-6, (sorted.front() - begin0) * 1e-6,
         (sorted[n / 2] - begin0) * 1e-6, (sorted.back() - begin0) * 1e-6);
  for (int wg = 0; wg < 2; ++wg) {
    const int b = wg == 0 ? prof::kWg0 : prof::kWg1;
    const int end_ns = wg == 0 ? prof::kWg0EndNs : prof::kWg1EndNs;
    double total = 0, job = 0, full = 0, ml = 0, epi = 0, kbs = 0, tiles = 0, ns = 0;
    double parts[4] = {0, 0, 0, 0};  // the epilogue's: other warpgroup, staging, dst, stores
    double epi_def = 0, def_tiles = 0, def_parts = 0, def_parts_ml = 0;  // deferred epilogues
    for (int c = 0; c < n; ++c) {
      total += span(c, b + prof::kWgBeginClk, b + prof::kWgEndClk);
      job += at(c, b + prof::kWgJobWait);
      full += at(c, b + prof::kWgFullWait);
      ml += at(c, b + prof::kWgMainloop);
      epi += at(c, b + prof::kWgEpilogue);
      kbs += at(c, b + prof::kWgKBlocks);
      tiles += at(c, b + prof::kWgTiles);
      for (int i = 0; i < 4; ++i) parts[i] += at(c, b + prof::kWgEpiBothWg + i);
      epi_def += at(c, b + prof::kWgEpiDeferred);
      def_tiles += at(c, b + prof::kWgDeferredTiles);
      def_parts += at(c, b + prof::kWgDeferredParts);
      def_parts_ml += at(c, b + prof::kWgDeferredPartsInMainloop);
      ns += at(c, end_ns) - at(c, prof::kBeginNs);
    }
    const double other = total - job - ml - epi;
    printf("  wg%d: %.0f Mcycles over %d CTAs (%.2f GHz): job wait %.1f%%, mainloop %.1f%% "
           "(stage data wait %.1f%%), epilogue %.1f%%, rest %.1f%%\n",
           wg, total * 1e-6, n, ns > 0 ? total / ns : 0.0, 100 * job / total, 100 * ml / total,
           100 * full / total, 100 * epi / total, 100 * other / total);
    if (tiles > 0 && kbs > 0)
      printf("       per tile: mainloop %.0f cycles (%.1f stages: %.0f cycles a stage, the tensor "
             "cores' floor 1024; %.0f less the data waits, which overlap wgmma in flight), "
             "epilogue %.0f, job wait %.0f\n",
             ml / tiles, kbs / tiles, ml / kbs, (ml - full) / kbs, epi / tiles, job / tiles);
    // Staged tiles' parts per staged tile; deferred tiles' own epilogue and parts per deferred
    // tile (the parts also count in the mainloop, or in "rest" where they ran on their own).
    const double staged = tiles - def_tiles;
    if (staged > 0)
      printf("       staged epilogue per tile (%.0f tiles): other warpgroup %.0f, math + staging "
             "%.0f, gate_up + row destinations %.0f, reads + stores %.0f, fence + release %.0f "
             "cycles\n",
             staged, parts[0] / staged, parts[1] / staged, parts[2] / staged, parts[3] / staged,
             (epi - epi_def - parts[0] - parts[1] - parts[2] - parts[3]) / staged);
    if (def_tiles > 0)
      printf("       deferred epilogue per tile (%.0f tiles): at the tile's end %.0f cycles, its "
             "deferred parts %.0f (%.0f of them inside the next mainloop)\n",
             def_tiles, epi_def / def_tiles, def_parts / def_tiles, def_parts_ml / def_tiles);
  }
  double total = 0, job = 0, empty = 0, rows = 0, tiles = 0;
  for (int c = 0; c < n; ++c) {
    const int b = prof::kProducer;
    total += span(c, b + prof::kPBeginClk, b + prof::kPEndClk);
    job += at(c, b + prof::kPJobEmptyWait);
    empty += at(c, b + prof::kPEmptyWait);
    rows += at(c, b + prof::kPRowsWait);
    tiles += at(c, b + prof::kPTiles);
  }
  printf("  producer: %.0f tiles, waiting for a free stage %.1f%%, for a job slot %.1f%%, for "
         "rows %.1f%%\n",
         tiles, 100 * empty / total, 100 * job / total, 100 * rows / total);
#else
  (void)label;
  (void)grid;
#endif
}

}  // namespace engine_profile
