// How CrossEntropyGrad (ffi/impls/cross_entropy_grad.cu) splits a row of logits: a cluster of
// CTAs per row, each holding a segment of it in shared memory, so that the row is read from
// memory once (the log-sum-exp needs all of it before the first d_logits element). Segments
// up to kSegmentBytes let four CTAs share an SM, so that some load while others compute and
// store (a 30B chunk on an H100, queued alone: 0.410 ms at four, 0.447 at two; inside the
// training step 0.385 either way, against ~0.31 at the H100's bandwidth: benchmarks/RESULTS.md,
// session 29); a longer row takes segments up to kSoloSegmentBytes, one CTA per SM; past that
// the CTAs read their segment from memory three times (max, sum, d_logits; no vocabulary is too
// large).
#pragma once

#include <cstdint>
#include <initializer_list>

namespace megamoe::heuristics {

struct CrossEntropySplit {
  int cluster;      // CTAs per row (a thread-block cluster: 1..kCrossEntropyMaxCluster)
  int64_t segment;  // logits per CTA, a multiple of 4 (16-byte aligned when vocab % 4 == 0)
  bool cached;      // segment held in shared memory (else read from memory)
};

// Clusters past 8 CTAs are "non-portable": sm_90 takes up to 16 with the kernel's opt-in.
inline constexpr int kCrossEntropyMaxCluster = 16;
// Four CTAs of 52 KB and their static shared memory fit an sm_90 SM (228 KB).
inline constexpr int64_t kSegmentBytes = 52 * 1024;
inline constexpr int64_t kSoloSegmentBytes = 200 * 1024;

inline CrossEntropySplit SplitCrossEntropyRow(int64_t vocab) {
  for (const int64_t budget : {kSegmentBytes, kSoloSegmentBytes}) {
    const int64_t cluster = (vocab * 4 + budget - 1) / budget;
    if (cluster <= kCrossEntropyMaxCluster) {
      const int64_t per_cta = (vocab + cluster - 1) / cluster;
      return {int(cluster), (per_cta + 3) / 4 * 4, true};
    }
  }
  const int64_t per_cta = (vocab + kCrossEntropyMaxCluster - 1) / kCrossEntropyMaxCluster;
  return {kCrossEntropyMaxCluster, (per_cta + 3) / 4 * 4, false};
}

}  // namespace megamoe::heuristics
