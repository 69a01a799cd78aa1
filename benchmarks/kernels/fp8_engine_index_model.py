"""A CPU model of the FP8 tile engine's index arithmetic (ffi/gemm/sm90_moe_tile_engine.cuh,
E4m3Operands), checked end to end on one L1 tile and one L2 tile: no GPU, no CUDA. A model is
a transcription of the code, not the code: it checks the scheme and the arithmetic as written
in the engine (and fails on each index mutation tried: the row + 8 scale pick, the A-scale box
offset, the descriptor k-step, the staging swizzle, the B-scale lane shuffle, L2's B blocks).

What is modelled, each as the engine's code computes it:
  - TMA, box {128 bytes, 128 rows}, SWIZZLE_128B into a 1024-aligned stage: byte (r, c) at
    r * 128 + ((c / 16) ^ (r % 8)) * 16 + c % 16;
  - wgmma m64n128k32 e4m3, both operands K-major, descriptor SW128 (SBO 1024 B, start advanced
    32 B per k-step): element (m, k) of k-step ks read at swizzle(start + (m % 8) * 128 +
    (m / 8) * 1024 + k), the hardware's 128B swizzle being address bits [4, 7) ^= bits [7, 10);
  - the accumulator fragment of m64nN (PTX: d[i] -> row 16 warp + lane / 4 + 8 ((i / 2) % 2),
    column 8 (i / 4) + 2 (lane % 4) + i % 2), the promotion acc[64 half + i] += tmp[i] * (sa[row
    or row + 8] * sb[half]) with the A scales at box offset row_begin % 4, the B scales from
    [E, K/128, N/128] through the producer's lane shuffle (lane 2 kb + half);
  - L1's FP8 epilogue: SwiGLU on the bf16-rounded gate / up, h rounded to bf16, quad amax,
    Fp8BlockScale, e4m3 staging (b16 stores, chunk XOR row % 8) and the 16-byte row reads into
    h_q[row, n_block * 128 + c], h_scale[n_block * pitch + row].
The result is compared with the definition computed directly (jax_megamoe/fp8.py's rounding,
numpy): the dequantised products in float64, h from bf16 gate / up, 1 x 128 quantisation;
for L2, y of the tile's 256 columns (L2 N-block 1: B blocks 2 nb, 2 nb + 1) from the model's
h_q / h_scale read back as L2's A through the same mainloop.
Index errors show as large differences; the expected differences are fp32-vs-float64 summation
order only (h bytes may differ where that flips a bf16 rounding).

Run: python benchmarks/kernels/fp8_engine_index_model.py (a few seconds).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
SLOT_ROW = 256  # staging slot pitch (bytes)


def frag(lane, warp, i):
  """(row, column) of accumulator register i of a thread (PTX wgmma D fragment, fp32)."""
  return 16 * warp + lane // 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)


def swizzle(addr):
  return addr ^ (((addr >> 7) & 7) << 4)


def tma_box(tile: np.ndarray) -> np.ndarray:
  """[rows, 128] bytes -> smem bytes of a SWIZZLE_128B box (1024-aligned destination)."""
  rows = tile.shape[0]
  smem = np.zeros(rows * 128, np.uint8)
  for r in range(rows):
    for c in range(128):
      smem[r * 128 + ((c // 16) ^ (r % 8)) * 16 + c % 16] = tile[r, c]
  return smem


def wgmma_fp8(smem_a, a_off, smem_b, b_off, n=128):
  """tmp[m, n] = sum over 4 k-steps of A(m, k) B(n, k), operands read through descriptors."""
  def read(smem, off, rows):
    out = np.zeros((rows, 128), np.float32)
    for ks in range(4):
      start = off + ks * 32
      for m in range(rows):
        for k in range(32):
          addr = swizzle(start + (m % 8) * 128 + (m // 8) * 1024 + k)
          out[m, ks * 32 + k] = smem[addr:addr + 1].view(E4M3)[0].astype(np.float32)
    return out
  a = read(smem_a, a_off, 64)
  b = read(smem_b, b_off, n)
  return a.astype(np.float64) @ b.astype(np.float64).T  # the tensor core's sum, idealised


def fp8_block_scale(amax, pow2):
  s = np.float32(max(np.float32(amax) * np.float32(1.0 / 448.0), np.finfo(np.float32).tiny))
  if pow2:
    m, e = np.frexp(s)
    s = np.float32(np.ldexp(np.float32(1.0), e - 1 if m == 0.5 else e))
  return s


def to_e4m3(v):
  return np.clip(np.float32(v), -448.0, 448.0).astype(E4M3)


def silu_mul(g, u):
  g, u = np.float32(g), np.float32(u)
  return g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u


def mainloop(aq, a_scale, row_begin, bq, b_scale, bcol):
  """mainloop_fp8 over one tile: aq [rows, K] e4m3 bytes, a_scale [K/128, pitch], bq [N, K]
  (one expert, K-major), b_scale [K/128, N/128], bcol the two 128-row blocks of B (halves).
  Returns each thread's 128 promoted accumulators, keyed (wg, warp, lane)."""
  rows_total, k = aq.shape
  kb_count = k // 128
  acc = {}
  for wg, warp, lane in itertools.product(range(2), range(4), range(32)):
    acc[wg, warp, lane] = np.zeros(128, np.float32)
  # producer lane shuffle: lane 2 kb + half holds (kb, half)
  b_scale_first = [b_scale[l // 2, bcol[l & 1]] if l // 2 < kb_count else 0.0
                   for l in range(32)]
  for kb in range(kb_count):
    a_tile = np.zeros((128, 128), np.uint8)
    valid = min(128, rows_total - row_begin)
    a_tile[:valid] = aq[row_begin:row_begin + valid, kb * 128:(kb + 1) * 128]
    smem_a = tma_box(a_tile)
    smem_b = [tma_box(bq[c * 128:(c + 1) * 128, kb * 128:(kb + 1) * 128]) for c in bcol]
    sa_row0 = row_begin & ~3
    box = np.zeros(132, np.float32)  # TMA fills past the matrix's rows with zeros
    n = min(132, rows_total - sa_row0)
    box[:n] = a_scale[kb, sa_row0:sa_row0 + n]
    sb = [b_scale_first[2 * kb + half] for half in range(2)]
    for wg in range(2):
      for half in range(2):
        tmp_full = wgmma_fp8(smem_a, wg * 64 * 128, smem_b[half], 0)  # [64, 128]
        for warp, lane in itertools.product(range(4), range(32)):
          row = 64 * wg + warp * 16 + (lane >> 2)
          sa0, sa1 = box[(row_begin & 3) + row], box[(row_begin & 3) + row + 8]
          s0, s1 = np.float32(sa0 * sb[half]), np.float32(sa1 * sb[half])
          a = acc[wg, warp, lane]
          for i in range(64):
            r, c = frag(lane, warp, i)
            t = np.float32(tmp_full[r, c])
            a[64 * half + i] = np.float32(t * (s1 if i & 2 else s0) + a[64 * half + i])
  return acc


def run(pow2: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  H, F, E = 512, 256, 2  # L1: four K-stages, F: two h blocks; L2: two N-blocks of H
  expert, n_block, row_begin, pool_rows = 1, 1, 131, 400  # row_begin % 4 = 3: the box offset
  pitch = -(-pool_rows // 128) * 128
  kb_count = H // 128
  # Pool rows (e4m3) and their K-block-major scales [H/128, pitch], as dispatch lays them out.
  x = rng.standard_normal((pool_rows, H)).astype(np.float32)
  xq = np.zeros((pool_rows, H), np.uint8)
  xs = np.zeros((kb_count, pitch), np.float32)
  for r in range(pool_rows):
    for b in range(kb_count):
      blk = x[r, b * 128:(b + 1) * 128].astype(BF16).astype(np.float32)
      s = fp8_block_scale(np.abs(blk).max(), pow2)
      xq[r, b * 128:(b + 1) * 128] = to_e4m3(blk / s).view(np.uint8)
      xs[b, r] = s
  # Weights K-major [E, 2F, H] with scales [E, H/128, 2F/128] (cuda_fp8.quantize_weights).
  wq = rng.integers(0, 256, (E, 2 * F, H), dtype=np.uint8)
  wq[(wq & 0x7f) == 0x7f] = 0  # no NaN bytes
  ws = rng.uniform(0.001, 0.01, (E, kb_count, 2 * F // 128)).astype(np.float32)
  bcol = (n_block, F // 128 + n_block)  # gate block, up block

  acc = mainloop(xq, xs, row_begin, wq[expert], ws[expert], bcol)

  # ---- L1's FP8 epilogue
  h_q = np.full((pool_rows, F), 0xff, np.uint8)
  h_scale = np.full((F // 128, pitch), np.nan, np.float32)
  for wg in range(2):
    slot = np.zeros(64 * SLOT_ROW, np.uint8)
    quad_amax = {}
    hv = {}
    for warp, lane in itertools.product(range(4), range(32)):
      a = acc[wg, warp, lane]
      v = np.zeros((16, 2, 2), np.float32)
      for ii, hh, e in itertools.product(range(16), range(2), range(2)):
        g = np.float32(np.float32(a[4 * ii + 2 * hh + e]).astype(BF16))
        u = np.float32(np.float32(a[4 * (ii + 16) + 2 * hh + e]).astype(BF16))
        v[ii, hh, e] = np.float32(silu_mul(g, u).astype(BF16))
      hv[warp, lane] = v
      for hh in range(2):
        key = (warp, lane >> 2, hh)
        quad_amax[key] = max(quad_amax.get(key, 0.0), float(np.abs(v[:, hh, :]).max()))
    for warp, lane in itertools.product(range(4), range(32)):
      v = hv[warp, lane]
      frag_row = warp * 16 + (lane >> 2)
      frag_base = frag_row * SLOT_ROW + (lane & 3) * 2
      frag_sw = lane >> 2
      for hh in range(2):
        s = fp8_block_scale(quad_amax[warp, lane >> 2, hh], pow2)
        inv = np.float32(1.0) / s
        for ii in range(16):
          lo, hi = v[ii, hh]
          q = [to_e4m3(lo * inv), to_e4m3(hi * inv)] if pow2 else [to_e4m3(lo / s),
                                                                   to_e4m3(hi / s)]
          addr = frag_base + hh * 8 * SLOT_ROW + ((((ii >> 1) ^ frag_sw) << 4) | ((ii & 1) << 3))
          slot[addr] = q[0].view(np.uint8)
          slot[addr + 1] = q[1].view(np.uint8)
        r = 64 * wg + frag_row + 8 * hh
        if (lane & 3) == 0 and r < 128:
          h_scale[n_block, row_begin + r] = s
    for t in range(128):
      chunk, row0 = t & 7, t >> 3
      for k in range(4):
        off = (row0 + 16 * k) * SLOT_ROW + ((chunk ^ (row0 & 7)) << 4)
        r = 64 * wg + row0 + 16 * k
        col = n_block * 128 + chunk * 16
        h_q[row_begin + r, col:col + 16] = slot[off:off + 16]

  # ---- the definition, directly
  xd = xq.view(E4M3).astype(np.float64) * np.repeat(xs[:, :pool_rows].T, 128, axis=1)
  wd = wq[expert].view(E4M3).astype(np.float64)
  wd = wd * np.repeat(np.repeat(ws[expert].T, 128, axis=0), 128, axis=1)  # [2F, H]
  rows = slice(row_begin, row_begin + 128)
  gate_up = (xd[rows] @ wd.T).astype(np.float32).astype(BF16).astype(np.float32)
  cols = slice(n_block * 128, (n_block + 1) * 128)
  h = silu_mul(gate_up[:, :F][:, cols], gate_up[:, F:][:, cols]).astype(BF16)
  h = h.astype(np.float32)
  want_s = np.array([fp8_block_scale(np.abs(h[r]).max(), pow2) for r in range(128)],
                    np.float32)
  want_q = to_e4m3(h / want_s[:, None]).view(np.uint8)
  got_q = h_q[rows, cols]
  got_s = h_scale[n_block, row_begin:row_begin + 128]
  got = got_q.view(E4M3).astype(np.float64) * got_s[:, None]
  want = want_q.view(E4M3).astype(np.float64) * want_s[:, None]
  rel = np.sqrt(np.sum((got - want) ** 2) / np.sum(want ** 2))
  bytes_off = int(np.sum(got_q != want_q))
  scales_off = int(np.sum(got_s != want_s))
  print(f"pow2={pow2}: h rel err {rel:.2e}, bytes off {bytes_off}/{got_q.size}, "
        f"scales off {scales_off}/128")
  assert rel < 1e-2 and bytes_off <= got_q.size // 50 + 2, "index arithmetic does not match"

  # ---- L2 on the kernel's h (both h blocks filled: the other n_block by the definition),
  # y columns of L2 n_block 1 (of H / 256): B halves = w_down blocks 2 nb, 2 nb + 1.
  other = 1 - n_block
  oc = slice(other * 128, (other + 1) * 128)
  h_o = silu_mul(gate_up[:, :F][:, oc], gate_up[:, F:][:, oc]).astype(BF16).astype(np.float32)
  for r in range(128):
    s = fp8_block_scale(np.abs(h_o[r]).max(), pow2)
    h_q[row_begin + r, oc] = to_e4m3(h_o[r] / s).view(np.uint8)
    h_scale[other, row_begin + r] = s
  h_q[:row_begin] = 0
  h_q[row_begin + 128:] = 0
  h_scale[np.isnan(h_scale)] = 0
  wdq = rng.integers(0, 256, (E, H, F), dtype=np.uint8)
  wdq[(wdq & 0x7f) == 0x7f] = 0
  wds = rng.uniform(0.001, 0.01, (E, F // 128, H // 128)).astype(np.float32)
  l2_nb = 1
  acc2 = mainloop(h_q, h_scale, row_begin, wdq[expert], wds[expert], (2 * l2_nb, 2 * l2_nb + 1))
  y = np.zeros((128, 256), np.float64)
  for (wg, warp, lane), a in acc2.items():
    for j in range(128):
      r, c = frag(lane, warp, j)
      y[64 * wg + r, c] = a[j]
  hd = h_q[rows].view(E4M3).astype(np.float64) * np.repeat(h_scale[:, rows].T, 128, axis=1)
  wdd = wdq[expert].view(E4M3).astype(np.float64)
  wdd = wdd * np.repeat(np.repeat(wds[expert].T, 128, axis=0), 128, axis=1)  # [H, F]
  y_want = hd @ wdd[l2_nb * 256:(l2_nb + 1) * 256].T
  y_rel = np.sqrt(np.sum((y - y_want) ** 2) / np.sum(y_want ** 2))
  print(f"pow2={pow2}: L2 y rel err {y_rel:.2e}")
  assert y_rel < 1e-5, "L2 index arithmetic does not match"


if __name__ == "__main__":
  # The fragment of two N=128 halves is bf16's m64n256 fragment (acc[64 half + i]).
  for lane, warp, half, i in itertools.product(range(32), range(4), range(2), range(64)):
    r, c = frag(lane, warp, i)
    assert (r, 128 * half + c) == frag(lane, warp, 64 * half + i)
  run(pow2=False)
  run(pow2=True)
  print("OK")
