"""A CPU model of the deferred epilogues' index arithmetic (ffi/gemm/sm90_moe_tile_engine.cuh,
kDeferL2Epilogue, and kDeferL1Epilogue in check_l1): from the wgmma m64n256 accumulator
fragment of every thread of a warpgroup,
through the bf16 pairs (acc_word), the 32 pending words (pend), the quad transpose and the
16-byte stores (store_group), to the destination rows; no GPU, no CUDA. A model is a
transcription of the code, not the code: it checks the scheme and the arithmetic as written.

Checked: every element of the warpgroup's 64 x 256 tile lands once, at its row and column,
whether its column group is stored at the epilogue (m < kFirstDeferredGroup) or by a later part
(m >= kFirstDeferredGroup, pend[8 g + 2 j + hh]); rows past the tile (row_dst null) are not
written; and each warp store instruction writes 64 contiguous bytes in each of 8 rows. It also
fails on each index mutation it tries (the transpose's exchanges, the pend index, the store
column), so that a passing run means something.

Run: python benchmarks/kernels/deferred_epilogue_index_model.py (under a second).
"""

from __future__ import annotations

import itertools

import numpy as np

FIRST_DEFERRED_GROUP = 4  # kFirstDeferredGroup
DEFER_PARTS = 8 - FIRST_DEFERRED_GROUP  # kL2DeferParts


def fragment(acc_tile: np.ndarray, warp: int, lane: int) -> np.ndarray:
  """acc[0..127] of a thread: acc[4 i + 2 hh + e] = row 16 warp + lane / 4 + 8 hh, column
  8 i + 2 (lane % 4) + e (the PTX m64nN fp32 accumulator layout)."""
  acc = np.empty(128, np.int64)
  for i, hh, e in itertools.product(range(32), range(2), range(2)):
    acc[4 * i + 2 * hh + e] = acc_tile[16 * warp + lane // 4 + 8 * hh, 8 * i + 2 * (lane % 4) + e]
  return acc


def pack(lo: int, hi: int) -> tuple[int, int]:
  """pack_bf16x2: a 32-bit word of two elements (a pair here: the model tracks which element
  goes where, not its bits)."""
  return (lo, hi)


def quad_transpose(words: list[list[tuple]], mutate: str = "") -> list[list[tuple]]:
  """detail::quad_transpose over the 4 lanes of a quad: words[q] = lane q's x[0..3]; the two
  __shfl_xor_sync exchanges exactly as written."""
  x = [list(w) for w in words]
  # across bit 1: lanes with q & 2 send x[0], x[1], the others x[2], x[3]
  send = [(x[q][0], x[q][1]) if q & 2 else (x[q][2], x[q][3]) for q in range(4)]
  step1 = 1 if mutate == "xor1_first" else 2
  for q in range(4):
    a0, a1 = send[q ^ step1]
    if q & 2:
      x[q][0], x[q][1] = a0, a1
    else:
      x[q][2], x[q][3] = a0, a1
  # across bit 0: lanes with q & 1 send x[0], x[2], the others x[1], x[3]
  send = [(x[q][0], x[q][2]) if q & 1 else (x[q][1], x[q][3]) for q in range(4)]
  for q in range(4):
    c0, c1 = send[q ^ 1]
    if q & 1:
      x[q][0], x[q][2] = c0, c1
    else:
      x[q][1], x[q][3] = c0, c1
  return x


def run(rows_in_tile: int, mutate: str = ""):
  """The warpgroup's stores of one tile (wg 0: its rows are tile rows 0..63). Returns the
  accumulator tile, the destination (-1: not written), the count of writes per element, and
  per warp store instruction each lane's (row, first column)."""
  rng = np.random.default_rng(0)
  acc_tile = rng.integers(0, 1 << 30, size=(64, 256))
  dest = np.full((64, 256), -1, np.int64)
  writes = np.zeros((64, 256), np.int64)
  instructions = []
  for warp in range(4):
    accs = [fragment(acc_tile, warp, lane) for lane in range(32)]

    def acc_word(lane, m, j, hh):
      i = 4 * m + j
      a = accs[lane]
      return pack(a[4 * i + 2 * hh], a[4 * i + 2 * hh + 1])

    # pend of every lane, as the epilogue fills it
    pend = [[None] * (8 * DEFER_PARTS) for _ in range(32)]
    for lane, g, j, hh in itertools.product(range(32), range(DEFER_PARTS), range(4), range(2)):
      idx = 8 * g + 2 * j + hh
      if mutate == "pend_index":
        idx = 8 * g + j + 4 * hh
      pend[lane][idx] = acc_word(lane, FIRST_DEFERRED_GROUP + g, j, hh)

    def store_group(m, word):
      for hh in range(2):
        per_lane = {}
        for quad in range(8):
          lanes = [4 * quad + q for q in range(4)]
          x = quad_transpose([[word(l, j, hh) for j in range(4)] for l in lanes], mutate)
          row = 16 * warp + quad + 8 * hh  # pend_row + 8 hh (lane / 4 = quad)
          if row >= rows_in_tile:
            continue  # row_dst null
          for q, lane in enumerate(lanes):
            col0 = 32 * m + 8 * (lane & 3)
            if mutate == "store_column":
              col0 = 32 * m + 8 * q * 2 % 32
            for w, pair in enumerate(x[q]):
              for e, value in enumerate(pair):
                c = col0 + 2 * w + e
                if 0 <= c < 256:
                  dest[row, c] = value
                  writes[row, c] += 1
            per_lane[lane] = (row, col0)
        instructions.append(per_lane)

    for m in range(FIRST_DEFERRED_GROUP):  # at the epilogue, from the accumulators
      store_group(m, lambda lane, j, hh, m=m: acc_word(lane, m, j, hh))
    for p in range(DEFER_PARTS):  # the next tile's parts, from pend
      store_group(FIRST_DEFERRED_GROUP + p,
                  lambda lane, j, hh, p=p: pend[lane][8 * p + 2 * j + hh])
  return acc_tile, dest, writes, instructions


def check(rows_in_tile: int, mutate: str = "") -> list[str]:
  acc_tile, dest, writes, instructions = run(rows_in_tile, mutate)
  errors = []
  inside = np.arange(64)[:, None] < rows_in_tile
  if np.any(writes[inside.repeat(256, 1)] != 1):
    errors.append("an element inside the tile not written exactly once")
  if np.any(writes[~inside.repeat(256, 1)] != 0):
    errors.append("a row past the tile written")
  if np.any(np.where(inside, dest != acc_tile, False)):
    errors.append("an element written with another element's value")
  for per_lane in instructions:  # 8 rows x 64 contiguous bytes per warp instruction
    by_row = {}
    for row, col0 in per_lane.values():
      by_row.setdefault(row, []).append(col0)
    for cols in by_row.values():
      cols = sorted(cols)
      if cols != list(range(cols[0], cols[0] + 32, 8)) or cols[0] % 32:
        errors.append("a warp store not 64 contiguous bytes of a row")
        break
  return errors


FIRST_DEFERRED_L1_GROUP = 2  # kFirstDeferredL1Group
L1_DEFERRED_GROUPS = 4 - FIRST_DEFERRED_L1_GROUP  # kL1DeferredGroups, two parts each


def check_l1(rows_in_tile: int, mutate: str = "", parts_per_group: int = 2) -> list[str]:
  """L1 (kDeferL1Epilogue): accumulator columns 0..127 are gate, 128..255 up; h column c of row
  r must receive (gate[r, c], up[r, c]), SwiGLU's two inputs (the model tracks them, not the
  math). h groups 0..1 from the accumulators at the epilogue, 2..3 from pend[16 g + 2 j + hh]
  (gate) and pend[16 g + 8 + 2 j + hh] (up), parts_per_group parts a group
  (MEGAMOE_DEFER_L1_PARTS_PER_GROUP): each does 4 / parts_per_group blocks; a group's earlier
  parts keep their h words in pend where their gate pairs were, its last part stores the group.
  swiglu_blocks pairs the gate pair gate(j, hh) with the up pair up(j, hh) element by element."""
  rng = np.random.default_rng(1)
  acc_tile = rng.integers(0, 1 << 30, size=(64, 256))
  got = {}
  errors = []
  for warp in range(4):
    accs = [fragment(acc_tile, warp, lane) for lane in range(32)]

    def acc_pair_of(lane, i, hh):
      return pack(accs[lane][4 * i + 2 * hh], accs[lane][4 * i + 2 * hh + 1])

    pend = [[None] * 32 for _ in range(32)]
    for lane, g, j, hh in itertools.product(range(32), range(L1_DEFERRED_GROUPS), range(4),
                                            range(2)):
      i = 4 * (FIRST_DEFERRED_L1_GROUP + g) + j
      up_i = 16 + i if mutate != "l1_up_block" else 15 + i
      pend[lane][16 * g + 2 * j + hh] = acc_pair_of(lane, i, hh)
      pend[lane][16 * g + 8 + 2 * j + hh] = acc_pair_of(lane, up_i, hh)

    def store_h_group(m, hw_of):  # hw_of(lane, j, hh) -> the pair of h elements
      for hh in range(2):
        for quad in range(8):
          lanes = [4 * quad + q for q in range(4)]
          x = quad_transpose([[hw_of(l, j, hh) for j in range(4)] for l in lanes])
          row = 16 * warp + quad + 8 * hh
          if row >= rows_in_tile:
            continue
          for q, lane in enumerate(lanes):
            for w, pair in enumerate(x[q]):
              for e, value in enumerate(pair):
                c = 32 * m + 8 * (lane & 3) + 2 * w + e
                got.setdefault((row, c), []).append(value)

    for m in range(FIRST_DEFERRED_L1_GROUP):  # gate(j, hh, e) = acc block 4 m + j, up 16 + ...
      store_h_group(m, lambda lane, j, hh, m=m: tuple(
          (acc_pair_of(lane, 4 * m + j, hh)[e], acc_pair_of(lane, 16 + 4 * m + j, hh)[e])
          for e in range(2)))
    nb = 4 // parts_per_group  # blocks of 8 columns a part
    for p in range(L1_DEFERRED_GROUPS * parts_per_group):  # part p: blocks j0 .. of group g
      g, q = p // parts_per_group, p % parts_per_group
      j0 = q * nb
      hw = [[None] * 2 for _ in range(32 * 4)]  # hw[4 lane + j][hh]
      for lane, j, hh in itertools.product(range(32), range(j0, j0 + nb), range(2)):
        hw[4 * lane + j][hh] = tuple(
            (pend[lane][16 * g + 2 * j + hh][e], pend[lane][16 * g + 8 + 2 * j + hh][e])
            for e in range(2))
      if q + 1 < parts_per_group:  # an earlier part: the h words where their gate pairs were
        for lane, j, hh in itertools.product(range(32), range(j0, j0 + nb), range(2)):
          slot = 16 * g + 2 * j + hh if mutate != "l1_half_slot" else 16 * g + 8 + 2 * j + hh
          pend[lane][slot] = hw[4 * lane + j][hh]
      else:  # the group's last part: blocks before j0 from pend, the rest just computed
        store_h_group(FIRST_DEFERRED_L1_GROUP + g, lambda lane, j, hh, g=g, hw=hw, j0=j0: (
            pend[lane][16 * g + 2 * j + hh] if j < j0 else hw[4 * lane + j][hh]))
  for r in range(64):
    for c in range(128):
      v = got.get((r, c), [])
      want = [(acc_tile[r, c], acc_tile[r, 128 + c])] if r < rows_in_tile else []
      # (a wrong index may leave a bare element where a (gate, up) pair belongs)
      if len(v) != len(want) or any(not isinstance(a, tuple) or a != b for a, b in zip(v, want)):
        errors.append(f"h[{r}, {c}]: {v} != {want}")
        break
  if any(c >= 128 for _, c in got):
    errors.append("a store past h's 128 columns")
  return errors


def main():
  for rows in (64, 37, 1, 0):
    errors = check(rows)
    assert not errors, (rows, errors)
    for parts_per_group in (1, 2, 4):
      errors = check_l1(rows, parts_per_group=parts_per_group)
      assert not errors, (rows, parts_per_group, errors[:3])
  for mutate in ("xor1_first", "pend_index", "store_column"):
    assert check(64, mutate), f"mutation {mutate} not caught"
  for mutate in ("l1_up_block", "l1_half_slot"):
    for parts_per_group in (2, 4):
      assert check_l1(64, mutate, parts_per_group), f"mutation {mutate} not caught"
  print("deferred epilogue index model: L2, every element once at its place, 64-byte row "
        "segments per warp store; L1 (1, 2 or 4 parts a group), every h element from its own "
        "gate and up; rows past the tile untouched; 5 mutations caught")


if __name__ == "__main__":
  main()
