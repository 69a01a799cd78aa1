// See launch_counts.h.
#include "ffi/common/launch_counts.h"

#include <atomic>

namespace megamoe {
namespace {

std::atomic<int64_t> g_counts[static_cast<int>(CountedLaunch::kNumCounted)];

}  // namespace

void CountLaunch(CountedLaunch what) {
  g_counts[static_cast<int>(what)].fetch_add(1, std::memory_order_relaxed);
}

int64_t LaunchCount(CountedLaunch what) {
  return g_counts[static_cast<int>(what)].load(std::memory_order_relaxed);
}

}  // namespace megamoe
