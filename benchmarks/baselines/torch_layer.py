"""The PyTorch expert-parallel MoE layer (TorchTitan style): sort routed slots by expert,
torch.distributed all_to_all_single (autograd-aware) to the ranks that own the experts, regroup
by local expert with groups padded to 16 rows, torch._grouped_mm SwiGLU experts, and back.

Run under torchrun, one process per GPU (gloo + CPU tensors when there is no GPU):

  torchrun --standalone --nproc_per_node=2 benchmarks/baselines/torch_layer.py \
      --routing routing.npz --shapes 30b,235b --out torch.json [--ep 2] [--time-budget 60]
  ... --check --inputs inputs.npz --outputs outputs.npz     numerics: y and gradients

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


def moe_layer(x, topk_ids, topk_weights, w_gate_up, w_down, *, group, ep: int,
              num_experts: int) -> torch.Tensor:
  """One rank: x [T, H] its tokens, topk_* [T, k], w_* its E/ep experts. Returns y [T, H]."""
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
  return {"ms": float(median.item()), "samples": len(times)}


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
  for shape in args.shapes.split(","):
    for recipe in args.recipes.split(","):
      prob = problem_lib.make_problem(shape, tokens_per_gpu, world, args.ep,
                                      num_experts=args.experts, top_k=ids.shape[1])
      base = {"impl": "torch", "shape": shape, "hidden": prob.hidden, "ffn": prob.ffn,
              "recipe": recipe}
      if recipe != "bf16":
        results += [dict(base, **{"pass": p, "status": "not available",
                                  "error": "the PyTorch baseline is bf16 only"})
                    for p in args.passes.split(",")]
        continue
      results += bench_case(args, prob, base, ids, weights, rank, world, ep_rank, group, device,
                            deadline)
      if rank == 0:
        write_results(args, results, device, partial=True)
        print(f"{shape} {recipe}: " + ", ".join(
            f"{r['pass']} {r['ms']:.2f} ms" if r["status"] == "ok" else f"{r['pass']} {r['status']}"
            for r in results if r["shape"] == shape and r["recipe"] == recipe), flush=True)
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
    layer = lambda: moe_layer(x, topk_ids, topk_w, wgu, wd, group=group, ep=args.ep,  # noqa
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
  return out


def run_check(args, rank, world, device):
  data = np.load(args.inputs)
  group, ep_rank = ep_group(args.ep, world)
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[str(data["dtype"])]
  x, ids, w, wgu, wd = local_inputs(data["x"], data["topk_ids"], data["topk_weights"],
                                    data["w_gate_up"], data["w_down"], rank=rank, world=world,
                                    ep_rank=ep_rank, ep=args.ep, device=device, dtype=dtype)
  y = moe_layer(x, ids, w, wgu, wd, group=group, ep=args.ep, num_experts=data["w_gate_up"].shape[0])
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
  parser.add_argument("--out", help="JSON results (rank 0)")
  parser.add_argument("--check", action="store_true", help="numerics mode: --inputs/--outputs")
  parser.add_argument("--inputs")
  parser.add_argument("--outputs")
  args = parser.parse_args(argv)
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
  finally:
    dist.destroy_process_group()


if __name__ == "__main__":
  main()
