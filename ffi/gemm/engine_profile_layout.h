// The layout of the tile engine's cycle accounting (ffi/gemm/sm90_engine_profile.cuh): one row
// of kSlots 64-bit values per CTA, kMaxCtas rows. Host code reads it too (the nanobind module
// hands the slot names to Python: jax_megamoe._megamoe.engine_profile_slots()).
#pragma once

namespace megamoe::fused::sm90::profile {

// A consumer warpgroup's sums (cycles unless named otherwise).
enum WgSlot : int {
  kWgJobWait = 0,   // waiting for the next job (the producer's scheduler, or the ring full)
  kWgFullWait,      // in the mainloop, waiting for a stage's data (bf16 mainloop only)
  kWgMainloop,      // first stage wait .. last wgmma retired, full waits included
  kWgEpilogue,      // last wgmma retired .. the tile's `stored` arrival
  kWgKBlocks,       // stages consumed (count)
  kWgTiles,         // tiles (count)
  // The bf16 epilogue's parts (their sum is kWgEpilogue, less the release at its end):
  kWgEpiBothWg,     // waiting for the other warpgroup to finish reading the tile's stages
  kWgEpiStage,      // math (SwiGLU) and fragments into the staging slots, warpgroup barrier
  kWgEpiDst,        // gate_up's TMA stores issued; waiting for the rows' destinations
  kWgEpiStore,      // the slots read back and the global stores issued
  // Deferred epilogues (MEGAMOE_DEFER_L1/L2_EPILOGUE): such a tile's epilogue (in kWgEpilogue,
  // none of the parts above) stores its first column groups and keeps the rest in registers;
  // the rest, the deferred parts, run in the next tile's first stages (inside kWgMainloop) or,
  // before an L2 tile or at the end, on their own (outside the mainloop and the epilogue).
  kWgEpiDeferred,   // deferred tiles' epilogue cycles
  kWgDeferredTiles, // deferred tiles (count)
  kWgDeferredParts, // the deferred parts' cycles, wherever they ran
  kWgDeferredPartsInMainloop,  // of those, the parts run inside a mainloop
  kWgBeginClk,      // clock at the role's start and end
  kWgEndClk,
  kWgSlots
};
// The producer warp's sums.
enum ProducerSlot : int {
  kPJobEmptyWait = 0,  // waiting for a free job slot (the consumers or signaller behind)
  kPEmptyWait,         // waiting for a free stage (the consumers behind: the good case)
  kPRowsWait,          // in hooks.wait_rows_ready (a tile's rows not yet there)
  kPTiles,
  kPBeginClk,
  kPEndClk,
  kProducerSlots
};
// Per CTA: the SM it ran on, global nanoseconds at the start and at each role's end, then the
// roles' sums.
enum CtaSlot : int {
  kSmId = 0,
  kBeginNs,
  kProducerEndNs,
  kWg0EndNs,
  kWg1EndNs,
  kWg0 = 8,
  kWg1 = kWg0 + kWgSlots,
  kProducer = kWg1 + kWgSlots,
  kSlots = kProducer + kProducerSlots
};

inline constexpr int kMaxCtas = 1024;

}  // namespace megamoe::fused::sm90::profile
