"""A CPU model (numpy, no GPU) of how much of the fused forward's combine could run beside its
L2 tiles at EP = 1 with uniform routing, if tokens were reduced as soon as their rows are
stored (per-token arrival counts; today the combine is phase 7, after every tile). It
simulates the kernel's tile order (ffi/impls/sm90_fused_moe.cu, TileSchedule: all L1 tiles,
then all L2 tiles, tile i on CTA i % G, each CTA in order) with fixed tile durations (cycles a
tile from the engine's accounting, FUSED_CORE_NOTES sessions 33-35), takes each token's ready
time (the last of its slots' L2 M-blocks done: every N-block of it), and the earliest a combine
could finish that reduces ready tokens at `share` of its measured rate while tiles run and at
its full rate after (the combine's measured time: fused_phases.py, RESULTS session 35, call 5).

L2 orders: bands = 1 is today's (M-block-major, experts in order); bands = b walks the M-blocks
of every expert in b bands of rows, band-major. Rows are in token order inside an expert (the
pool's order at one rank), so a band's tokens are ready once that band's tiles are; the price
is each expert's L2 weights read b times.

A model, not a measurement: it ignores the tiles' waits, the combine's and the tiles' shared
memory bandwidth (that is what `share` stands for) and the registers the combine's warps would
have (the producer warpgroup's).

Run: python benchmarks/kernels/combine_overlap_model.py (a few seconds).
"""

import numpy as np

def model(T=16384, K=8, E=128, H=2048, F=768, G=132, l1_cyc=38300, l2_cyc=16600,
          combine_ms=0.207, ghz=1.73, seed=0, share=1.0, bands=1):
  rng = np.random.default_rng(seed)
  ex = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # K distinct experts per token, uniform
  counts = np.bincount(ex.ravel(), minlength=E)
  blocks = (counts + 127) // 128
  first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
  order = np.argsort(ex.ravel(), kind="stable")  # slots by expert, token order within
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank_in_e = np.empty(T * K, int)
  rank_in_e[order] = np.arange(T * K) - starts[ex.ravel()[order]]
  slot_block = first_block[ex.ravel()] + rank_in_e // 128
  nb = blocks.sum()
  l1_n, l2_n = F // 128, H // 256
  # L2 M-block order: band-major (band of an M-block = its rank in its expert * bands / blocks)
  blk_expert = np.repeat(np.arange(E), blocks)
  blk_rank = np.arange(nb) - first_block[blk_expert]
  band = blk_rank * bands // blocks[blk_expert]
  l2_order = np.lexsort((blk_rank, blk_expert, band))  # position -> M-block
  n1, n2 = nb * l1_n, nb * l2_n
  dur = np.concatenate([np.full(n1, l1_cyc), np.full(n2, l2_cyc)]).astype(float)
  end = np.empty(n1 + n2)
  for c in range(G):
    idx = np.arange(c, n1 + n2, G)
    end[idx] = np.cumsum(dur[idx])
  l2_end_pos = end[n1:].reshape(nb, l2_n).max(axis=1)  # position p's tiles done
  l2_end = np.empty(nb)
  l2_end[l2_order] = l2_end_pos
  ready = np.sort(l2_end[slot_block].reshape(T, K).max(axis=1))
  gemm_end = end.max()
  cyc_ms = ghz * 1e6
  per_token = combine_ms * cyc_ms / T
  tau = 0.0
  for r in ready:
    tau = max(tau, r)
    tau += per_token / (share if tau < gemm_end else 1.0)
  base = gemm_end + T * per_token
  return dict(gemm_ms=gemm_end / cyc_ms, base_ms=base / cyc_ms, overlapped_ms=tau / cyc_ms,
              saved_ms=(base - tau) / cyc_ms)

if __name__ == "__main__":
  # Cycles a tile: 30B, the product's accounting (session 34: L1 ~36,400 + 1,900, L2 ~13,000 +
  # 3,600); 235B, L1 64 stages x 1,037 + ~7,200 of epilogue, L2 24 stages x ~1,500 (1,157 a
  # stage at 30B, 2,009 on a memory-bound H100, session 31) + ~4,300. The combine: call 5.
  shapes = {"30B": dict(),
            "235B": dict(H=4096, F=1536, l1_cyc=73600, l2_cyc=40300, combine_ms=0.401)}
  for name, shape in shapes.items():
    for bands in (1, 2, 4):
      for share in (1.0, 0.5, 0.25):
        m = model(share=share, bands=bands, **shape)
        print(f"{name} bands {bands} share {share}: GEMMs {m['gemm_ms']:.3f} + combine -> "
              f"{m['base_ms']:.3f} ms today, {m['overlapped_ms']:.3f} overlapped "
              f"(saves {m['saved_ms']:.3f})")
