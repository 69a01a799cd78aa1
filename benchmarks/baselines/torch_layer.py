"""The PyTorch expert-parallel MoE layer (TorchTitan style): sort routed slots by expert,
torch.distributed all_to_all_single (autograd-aware) to the ranks that own the experts, regroup
by local expert with groups padded to 16 rows, torch._grouped_mm SwiGLU experts, and back.

Run under torchrun, one process per GPU (gloo + CPU tensors when there is no GPU):

  torchrun --standalone --nproc_per_node=2 benchmarks/baselines/torch_layer.py \
      --routing routing.npz --shapes 30b,235b --out torch.json [--ep 2] [--time-budget 60]
  ... --check --inputs inputs.npz --outputs outputs.npz     numerics: y and gradients
  ... --variant lean,naive --profile    both layers side by side, each with a kernel table

--variant naive is the first version (fp32 [T, k, H] combine, memset + scatter permutations,
host syncs), kept to measure what the lean default saves; each record says its "variant".

routing.npz holds topk_ids [T, k] and topk_weights [T, k] for ALL tokens (rank r owns rows
[r * T/world, (r+1) * T/world)), so PyTorch routes exactly as the JAX implementations do.
Rank 0 writes the results. Only bf16 (TorchTitan's bf16 path); fp8 is recorded as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

sys.path.append(str(pathlib.Path(__file__).resolve().parents[2]))  # for `benchmarks`
from benchmarks import problem as problem_lib  # noqa: E402

ALIGN = 16  # torch._grouped_mm wants 16-row aligned group offsets (TorchTitan pads likewise)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
  """x [N, K] rows grouped by expert (group g ends at offs[g]), w [G, K, N'] -> [N, N']."""
  return torch._grouped_mm(x, w, offs=offs)


class _Permute(torch.autograd.Function):
  """a[index] for a permutation index with inverse `inverse`: the backward is the gather
  grad[inverse], not autograd's memset + sort + accumulating scatter."""

  @staticmethod
  def forward(ctx, a, index, inverse):
    ctx.save_for_backward(inverse)
    return a.index_select(0, index)

  @staticmethod
  def backward(ctx, grad):
    (inverse,) = ctx.saved_tensors
    return grad.index_select(0, inverse), None, None


def _to_groups(a, dest, spare, capacity):
  """Rows of a to rows dest of a [capacity, H] tensor; the spare rows (group padding, tail) are
  zeroed, as padding rows enter the weight gradients. No memset of the whole tensor."""
  out = a.new_empty(capacity, a.shape[1]).index_copy_(0, dest, a)
  return out.index_fill_(0, spare, 0)


class _ToGroups(torch.autograd.Function):
  """Arrival order -> expert groups padded to ALIGN rows; the backward is the gather grad[dest]."""

  @staticmethod
  def forward(ctx, a, dest, spare, capacity):
    ctx.save_for_backward(dest)
    return _to_groups(a, dest, spare, capacity)

  @staticmethod
  def backward(ctx, grad):
    (dest,) = ctx.saved_tensors
    return grad.index_select(0, dest), None, None, None


class _FromGroups(torch.autograd.Function):
  """Padded expert groups -> arrival order (padding dropped); the backward scatters back."""

  @staticmethod
  def forward(ctx, a, dest, spare):
    ctx.save_for_backward(dest, spare)
    ctx.capacity = a.shape[0]
    return a.index_select(0, dest)

  @staticmethod
  def backward(ctx, grad):
    dest, spare = ctx.saved_tensors
    return _to_groups(grad, dest, spare, ctx.capacity), None, None


def moe_layer(x, topk_ids, topk_weights, w_gate_up, w_down, *, group, ep: int,
              num_experts: int) -> torch.Tensor:
  """One rank: x [T, H] its tokens, topk_* [T, k], w_* its E/ep experts. Returns y [T, H].

  Lean: one host sync (the split sizes, as TorchTitan), every permutation a single gather or
  scatter pass with its inverse as the backward, and the top-k sum one bf16 bmm (fp32
  accumulation) instead of an fp32 [T, k, H] product."""
  num_tokens, top_k = topk_ids.shape
  local_experts = num_experts // ep
  ffn = w_down.shape[1]
  dev = x.device
  flat = topk_ids.reshape(-1)
  sorted_ids, order = torch.sort(flat, stable=True)
  slots = torch.arange(flat.numel(), device=dev)
  inverse = torch.empty_like(order).index_copy_(0, order, slots)  # N ints, not N x H
  # Per-expert counts from the sorted ids: CUDA bincount would sync on the host for its max.
  bounds = torch.arange(num_experts + 1, device=dev, dtype=sorted_ids.dtype)
  counts = torch.searchsorted(sorted_ids, bounds).diff()

  # Counts per (source, local expert) for the experts this rank owns.
  recv_counts = torch.empty_like(counts)
  dist.all_to_all_single(recv_counts, counts, group=group)
  recv_counts = recv_counts.view(ep, local_experts)
  splits = torch.stack([counts.view(ep, local_experts).sum(1), recv_counts.sum(1)])
  input_splits, output_splits = splits.tolist()  # the one host sync, as TorchTitan
  received = sum(output_splits)

  # Autograd's backward of this gather (on CUDA): a sort-based fp32 sum of the k copies.
  routed = x[order // top_k]
  recv = all_to_all_single_autograd(routed, output_splits, input_splits, group)

  # Arrival order is [source][local expert] blocks; dest: each arrival row's row in the
  # expert-major layout, groups padded to ALIGN rows. No sort: a block moves as a whole.
  group_rows = recv_counts.sum(0)
  padded_rows = (group_rows + ALIGN - 1) // ALIGN * ALIGN
  offs = torch.cumsum(padded_rows, 0)
  block_to = (offs - padded_rows) + torch.cumsum(recv_counts, 0) - recv_counts
  block_from = torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)
  block = torch.repeat_interleave(torch.arange(ep * local_experts, device=dev),
                                  recv_counts.reshape(-1), output_size=received)
  dest = torch.arange(received, device=dev) + (block_to.reshape(-1) - block_from)[block]
  # The other capacity - received = local_experts * ALIGN rows: each group's padding (fewer
  # than ALIGN rows) then the tail, exactly one ALIGN-slot each.
  capacity = received + local_experts * ALIGN  # static bound, no extra host sync
  slot = torch.arange(ALIGN, device=dev)
  is_tail = slot >= (padded_rows - group_rows)[:, None]
  tail = offs[-1] + torch.cumsum(is_tail.reshape(-1), 0) - 1
  spare = torch.where(is_tail, tail.view(local_experts, ALIGN), offs[:, None] - 1 - slot)
  spare = spare.reshape(-1)
  offs = offs.to(torch.int32)

  rows = _ToGroups.apply(recv, dest, spare, capacity)
  gate_up = grouped_mm(rows, w_gate_up, offs)
  act = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
  out = _FromGroups.apply(grouped_mm(act, w_down, offs), dest, spare)  # arrival order

  back = all_to_all_single_autograd(out, input_splits, output_splits, group)
  slot_out = _Permute.apply(back, inverse, order).view(num_tokens, top_k, -1)
  # y[t] = sum_j w[t, j] slot_out[t, j]: bf16 operands, fp32 accumulation in the bmm.
  y = torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), slot_out)
  return y.view(num_tokens, -1)


def moe_layer_naive(x, topk_ids, topk_weights, w_gate_up, w_down, *, group, ep: int,
                    num_experts: int) -> torch.Tensor:
  """The first version (--variant naive), kept to measure what the lean one saves: fp32
  [T, k, H] combine, memset + scatter permutations, bincount and repeat_interleave syncs."""
  num_tokens, top_k = topk_ids.shape
  local_experts = num_experts // ep
  ffn = w_down.shape[1]
  flat = topk_ids.reshape(-1)
  order = torch.argsort(flat, stable=True)
  counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)

  # Counts per (source, local expert) for the experts this rank owns.
  recv_counts = torch.empty_like(counts)
  dist.all_to_all_single(recv_counts, counts, group=group)
  recv_counts = recv_counts.view(ep, local_experts)
  input_splits = counts.view(ep, local_experts).sum(1).tolist()   # host sync, as TorchTitan
  output_splits = recv_counts.sum(1).tolist()

  routed = x[order // top_k]
  recv = all_to_all_single_autograd(routed, output_splits, input_splits, group)

  # Regroup [source][local expert] blocks by local expert, each group padded to ALIGN rows.
  local_id = torch.repeat_interleave(
      torch.arange(local_experts, device=x.device).repeat(ep), recv_counts.reshape(-1))
  regroup = torch.argsort(local_id, stable=True)
  group_rows = recv_counts.sum(0)
  padded_rows = (group_rows + ALIGN - 1) // ALIGN * ALIGN
  padded_start = torch.cumsum(padded_rows, 0) - padded_rows
  group_start = torch.cumsum(group_rows, 0) - group_rows
  sorted_id = local_id[regroup]
  position = torch.arange(sorted_id.numel(), device=x.device)
  dest = padded_start[sorted_id] + position - group_start[sorted_id]
  capacity = recv.shape[0] + local_experts * ALIGN  # static bound, no extra host sync
  offs = torch.cumsum(padded_rows, 0).to(torch.int32)
  rows = recv.new_zeros(capacity, x.shape[1]).index_put((dest,), recv[regroup])

  gate_up = grouped_mm(rows, w_gate_up, offs)
  act = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
  out = grouped_mm(act, w_down, offs)[dest]              # expert order, padding dropped
  out = out.new_zeros(out.shape).index_put((regroup,), out)   # arrival order

  back = all_to_all_single_autograd(out, input_splits, output_splits, group)
  slot_out = back.new_zeros(back.shape).index_put((order,), back)
  slot_out = slot_out.view(num_tokens, top_k, -1).float()
  y = (slot_out * topk_weights.unsqueeze(-1)).sum(1)
  return y.to(x.dtype)


LAYERS = {"lean": moe_layer, "naive": moe_layer_naive}


# --- set-up --------------------------------------------------------------------------------------

def init_distributed():
  use_cuda = torch.cuda.is_available()
  if use_cuda:  # before NCCL creates its communicators
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
  dist.init_process_group("nccl" if use_cuda else "gloo")
  return dist.get_rank(), dist.get_world_size(), torch.device("cuda" if use_cuda else "cpu")


def ep_group(ep: int, world: int):
  """This rank's expert-parallel group: consecutive ranks, as the JAX mesh ("data", "expert")."""
  if ep == world:
    return dist.group.WORLD, dist.get_rank()
  group, _ = dist.new_subgroups(group_size=ep)
  return group, dist.get_rank() % ep


def synchronize(device):
  if device.type == "cuda":
    torch.cuda.synchronize()


def timed(fn, device, *, warmup, reps, cap_s):
  """The slowest rank's median ms; every rep starts barrier-aligned."""
  for _ in range(warmup):
    fn()
  synchronize(device)
  times, start = [], time.perf_counter()
  for i in range(reps):
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    times.append((time.perf_counter() - t0) * 1e3)
    stop = torch.tensor([float(i + 1 >= 3 and time.perf_counter() - start > cap_s)],
                        device=device)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same rep
    if stop.item():
      break
  median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
  dist.all_reduce(median, op=dist.ReduceOp.MAX)
  return {"ms": float(median.item()), "samples": len(times), **queued(fn, device)}


def queued(fn, device, *, depth=5, samples=5):
  """The slowest rank's median per-call ms with `depth` calls back to back and one synchronize
  (as benchmarks/timing.measure_queued_ms for the JAX implementations)."""
  per_call = []
  for _ in range(samples):
    dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(depth):
      fn()
    synchronize(device)
    per_call.append((time.perf_counter() - t0) * 1e3 / depth)
  median = torch.tensor([statistics.median(per_call)], dtype=torch.float64, device=device)
  dist.all_reduce(median, op=dist.ReduceOp.MAX)
  return {"queued_ms": float(median.item()), "queue_depth": depth}


def local_inputs(global_x, global_ids, global_w, wgu, wd, *, rank, world, ep_rank, ep, device,
                 dtype):
  tokens = global_ids.shape[0] // world
  rows = slice(rank * tokens, (rank + 1) * tokens)
  experts = wgu.shape[0] // ep
  own = slice(ep_rank * experts, (ep_rank + 1) * experts)
  to = lambda a, dt=None: torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)  # noqa: E731
  return (to(global_x[rows], dtype).requires_grad_(), to(global_ids[rows], torch.int64),
          to(global_w[rows], torch.float32).requires_grad_(), to(wgu[own], dtype).requires_grad_(),
          to(wd[own], dtype).requires_grad_())


# --- modes ---------------------------------------------------------------------------------------

def write_results(args, results, device, partial: bool):
  meta = {"torch_version": torch.__version__, "device": device.type,
          "world_size": dist.get_world_size(), "backend": dist.get_backend(), "partial": partial}
  tmp = pathlib.Path(args.out + ".tmp")
  tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  tmp.replace(args.out)  # whole files only: the parent may read it after a kill


def run_benchmark(args, rank, world, device):
  routing = np.load(args.routing)
  ids, weights = routing["topk_ids"], routing["topk_weights"]
  tokens_per_gpu = ids.shape[0] // world
  group, ep_rank = ep_group(args.ep, world)
  results, deadline = [], time.monotonic() + args.time_budget
  shapes = args.shapes.split(",")
  args.profile_shape = "30b" if "30b" in shapes else shapes[0]
  if args.profile and device.type != "cuda" and rank == 0:
    print("--profile: CUDA only, nothing profiled on", device.type, flush=True)
  for shape in shapes:
    for recipe in args.recipes.split(","):
      for variant in args.variants:
        prob = problem_lib.make_problem(shape, tokens_per_gpu, world, args.ep,
                                        num_experts=args.experts, top_k=ids.shape[1])
        base = {"impl": "torch", "shape": shape, "hidden": prob.hidden, "ffn": prob.ffn,
                "recipe": recipe, "variant": variant}
        if recipe != "bf16":
          results += [dict(base, **{"pass": p, "status": "not available",
                                    "error": "the PyTorch baseline is bf16 only"})
                      for p in args.passes.split(",")]
          break  # one record per pass, not per variant
        case = bench_case(args, prob, base, ids, weights, rank, world, ep_rank, group, device,
                          deadline)
        results += case
        if rank == 0:
          write_results(args, results, device, partial=True)
          print(f"{shape} {recipe} {variant}: " + ", ".join(
              f"{r['pass']} {r['ms']:.2f} ms" if r["status"] == "ok"
              else f"{r['pass']} {r['status']}" for r in case), flush=True)
  return results


def bench_case(args, prob, base, ids, weights, rank, world, ep_rank, group, device, deadline):
  out = []
  if time.monotonic() > deadline:
    return [dict(base, **{"pass": p, "status": "skipped", "error": "time budget"})
            for p in args.passes.split(",")]
  try:
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    experts = prob.num_experts // args.ep
    rows = slice(rank * prob.tokens_per_gpu, (rank + 1) * prob.tokens_per_gpu)
    x = torch.randn(prob.tokens_per_gpu, prob.hidden, device=device, generator=gen,
                    dtype=torch.bfloat16).requires_grad_()
    wgu = (torch.randn(experts, prob.hidden, 2 * prob.ffn, device=device, generator=gen,
                       dtype=torch.bfloat16) * prob.hidden ** -0.5).requires_grad_()
    wd = (torch.randn(experts, prob.ffn, prob.hidden, device=device, generator=gen,
                      dtype=torch.bfloat16) * prob.ffn ** -0.5).requires_grad_()
    topk_ids = torch.from_numpy(ids[rows]).to(device, torch.int64)
    topk_w = torch.from_numpy(weights[rows]).to(device).requires_grad_()
    grad = torch.randn(prob.tokens_per_gpu, prob.hidden, device=device, generator=gen,
                       dtype=torch.bfloat16)
    moe = LAYERS[base["variant"]]
    layer = lambda: moe(x, topk_ids, topk_w, wgu, wd, group=group, ep=args.ep,  # noqa: E731
                        num_experts=prob.num_experts)
    params = (x, topk_w, wgu, wd)
  except Exception as e:  # noqa: BLE001  (recorded, not raised)
    return [dict(base, **{"pass": p, "status": "failed", "error": _short(e)})
            for p in args.passes.split(",")]

  state = {}

  def forward():
    state["y"] = layer()

  def backward_only():
    torch.autograd.grad(state["y"], params, grad, retain_graph=True)

  def two_forward_one_backward():
    with torch.no_grad():
      layer()
    torch.autograd.grad(layer(), params, grad)

  timing = dict(warmup=2, reps=args.reps, cap_s=args.case_cap)
  for name, fn in (("fwd", forward), ("bwd", backward_only), ("2f1b", two_forward_one_backward)):
    if name not in args.passes.split(","):
      continue
    try:
      if name == "bwd" and "y" not in state:
        forward()
      out.append(dict(base, **{"pass": name, "status": "ok"}, **timed(fn, device, **timing)))
    except Exception as e:  # noqa: BLE001
      status = "oom" if "out of memory" in str(e).lower() else "failed"
      out.append(dict(base, **{"pass": name, "status": status, "error": _short(e)}))
  state.clear()  # frees the last graph before the next case
  if args.profile and device.type == "cuda" and prob.shape == args.profile_shape:
    try:
      profile(lambda: torch.autograd.grad(layer(), params, grad), rank,
              f"{prob.shape} {base['variant']}: one forward + backward")
    except Exception as e:  # noqa: BLE001  (the timings are already recorded)
      print(f"profile failed: {_short(e)}", flush=True)
  return out


def profile(fn, rank, title):
  """Where the time goes: the CUDA kernels of fn, profiled on rank 0 (every rank runs fn, for
  its collectives). Runs after the timing, so it is warm and does not perturb it."""
  from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415
  dist.barrier()
  if rank != 0:
    fn()
    torch.cuda.synchronize()
    return
  with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    fn()
    torch.cuda.synchronize()
  print(f"\n--- profile, {title} (rank 0) ---", flush=True)
  print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def run_check(args, rank, world, device):
  data = np.load(args.inputs)
  group, ep_rank = ep_group(args.ep, world)
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[str(data["dtype"])]
  x, ids, w, wgu, wd = local_inputs(data["x"], data["topk_ids"], data["topk_weights"],
                                    data["w_gate_up"], data["w_down"], rank=rank, world=world,
                                    ep_rank=ep_rank, ep=args.ep, device=device, dtype=dtype)
  (variant,) = args.variants  # check mode: one variant per run
  y = LAYERS[variant](x, ids, w, wgu, wd, group=group, ep=args.ep,
                      num_experts=data["w_gate_up"].shape[0])
  grads = torch.autograd.grad(y, (x, w, wgu, wd), torch.from_numpy(data["dy"]).to(device, dtype)[
      rank * x.shape[0]:(rank + 1) * x.shape[0]])
  def gather(t):  # on the device (NCCL gathers device tensors), then to the host
    t = t.detach().float().contiguous()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return [part.cpu() for part in parts]

  gathered = {}
  for name, t in (("y", y), ("dx", grads[0]), ("dtopk_weights", grads[1])):
    gathered[name] = torch.cat(gather(t)).numpy()
  # Expert gradients: rank r holds expert block r % ep; sum the data-parallel replicas.
  for name, t in (("dw_gate_up", grads[2]), ("dw_down", grads[3])):
    parts = gather(t)
    gathered[name] = torch.cat([sum(parts[r] for r in range(e, world, args.ep))
                                for e in range(args.ep)]).numpy()
  return gathered


def _short(e: BaseException) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())[:600]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--routing", help="npz with topk_ids, topk_weights for all tokens")
  parser.add_argument("--shapes", default="30b,235b")
  parser.add_argument("--recipes", default="bf16")
  parser.add_argument("--passes", default=",".join(problem_lib.PASSES))
  parser.add_argument("--experts", type=int, default=problem_lib.NUM_EXPERTS)
  parser.add_argument("--ep", type=int, default=0, help="expert-parallel size (0: world)")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--case-cap", type=float, default=4.0, help="max seconds timing one pass")
  parser.add_argument("--time-budget", type=float, default=90.0)
  parser.add_argument("--variant", default="lean",
                      help="comma list of lean, naive (the first version, to measure the gap); "
                      "benchmark mode times each in turn, check mode takes one")
  parser.add_argument("--profile", action="store_true",
                      help="CUDA: torch.profiler table of one forward + backward of the 30b "
                      "shape (or the first shape), per variant, on rank 0")
  parser.add_argument("--out", help="JSON results (rank 0)")
  parser.add_argument("--check", action="store_true", help="numerics mode: --inputs/--outputs")
  parser.add_argument("--inputs")
  parser.add_argument("--outputs")
  args = parser.parse_args(argv)
  args.variants = args.variant.split(",")
  if not set(args.variants) <= set(LAYERS) or (args.check and len(args.variants) != 1):
    parser.error(f"--variant: one of {', '.join(LAYERS)} (check mode), or a comma list of them")
  rank, world, device = init_distributed()
  args.ep = args.ep or world
  try:
    if args.check:
      outputs = run_check(args, rank, world, device)
      if rank == 0:
        np.savez(args.outputs, **outputs)
    else:
      results = run_benchmark(args, rank, world, device)
      if rank == 0:
        write_results(args, results, device, partial=False)
    # Every rank done before any tears down: a gloo rank destroyed while its peer still held
    # the connection aborted now and then ("terminate called without an active exception").
    # Not in `finally`: after a failure on one rank the others must not wait here.
    dist.barrier()
  finally:
    dist.destroy_process_group()


if __name__ == "__main__":
  main()
