"""cuda_shards: CUDA sources compiled as several translation units (see ffi/common/shards.h)."""

load("@rules_cc//cc:defs.bzl", "cc_library")
load("@rules_cuda//cuda:defs.bzl", "cuda_library")

def cuda_shards(name, srcs, local_defines = [], target_compatible_with = [], **kwargs):
    """One cuda_library per shard of each source, gathered in the cc_library `name`.

    Shard s of n compiles its source with MEGAMOE_SHARD=s and MEGAMOE_SHARDS=n, so that the
    source's template instances compile in parallel (CMakeLists.txt does the same).

    Args:
      name: the gathering target.
      srcs: dict, source -> number of shards.
      local_defines: the defines of every shard, besides the two above.
      target_compatible_with: for every shard and the gathering target.
      **kwargs: the other attributes of every shard's cuda_library.
    """
    shards = []
    for src, count in srcs.items():
        stem = src.split("/")[-1][:-len(".cu")]
        for shard in range(count):
            shard_name = "%s_%s_%d" % (name, stem, shard)
            cuda_library(
                name = shard_name,
                srcs = [src],
                local_defines = local_defines + [
                    "MEGAMOE_SHARD=%d" % shard,
                    "MEGAMOE_SHARDS=%d" % count,
                ],
                target_compatible_with = target_compatible_with,
                **kwargs
            )
            shards.append(":" + shard_name)
    cc_library(
        name = name,
        target_compatible_with = target_compatible_with,
        deps = shards,
    )
