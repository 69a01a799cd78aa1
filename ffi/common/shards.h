// Translation-unit shards. A source of many heavy template instances (a CUTLASS GEMM family:
// about 40 s of nvcc per instance) is compiled as MEGAMOE_SHARDS translation units, shard
// MEGAMOE_SHARD holding the instances i with i % MEGAMOE_SHARDS == MEGAMOE_SHARD: every instance
// is compiled exactly once whatever the count, which only sets how many compile in parallel
// (CMakeLists.txt and BUILD choose it, the same in both). A source compiled without the defines
// is one shard holding every instance.
#pragma once

#include <type_traits>
#include <utility>

#ifndef MEGAMOE_SHARD
#define MEGAMOE_SHARD 0
#define MEGAMOE_SHARDS 1
#endif

namespace megamoe {

namespace detail {
template <int I, class F>
void CallIfInThisShard(F& f) {
  if constexpr (I % MEGAMOE_SHARDS == MEGAMOE_SHARD) f(std::integral_constant<int, I>{});
}
template <class F, int... I>
void ForEachInstanceOfThisShard(F& f, std::integer_sequence<int, I...>) {
  (CallIfInThisShard<I>(f), ...);
}
}  // namespace detail

// Calls f(std::integral_constant<int, i>{}) for every instance i < kCount of this shard; only
// those are instantiated.
template <int kCount, class F>
void ForEachInstanceOfThisShard(F f) {
  detail::ForEachInstanceOfThisShard(f, std::make_integer_sequence<int, kCount>{});
}

}  // namespace megamoe
