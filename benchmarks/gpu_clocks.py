"""What the GPU's clocks did while a benchmark ran: a summary of nvidia-smi's samples.

A kernel whose time moves by 10% between runs on one card (the fused 235B bf16 forward on an
H100, RESULTS session 38) needs its SM clock, power and the driver's clock-event reasons beside
it before the spread can be blamed on the kernel or on the card. Sampled by
`scripts/next_device_call.sh` (clocks_start / clocks_stop) with

  nvidia-smi --format=csv,noheader,nounits -lms 200 \
    --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active

and summarised here:

  python3 benchmarks/gpu_clocks.py SAMPLES.csv [--label NAME]

prints the samples' count, the SM clock and power draw (min / median / max), the hottest
temperature, and how many samples carried each clock-event reason (NVML's bits). Samples with
no reason but "GPU idle" are the gaps between benchmark steps and are left out of the clock and
power figures. Most of a benchmark step's samples fall in its compilation and host work, at the
idle boost clock, so the median says little about the kernels: the samples under the software
power cap (bit 0x4, set while the card holds its power limit) are summarised apart, as the clock
the kernels ran at when power bound them (session 39, H100: the 235B bf16 forward's kernels at
1.2-1.7 GHz there, against 1.98 unbound).
"""

from __future__ import annotations

import argparse
import statistics
import sys

# NVML's clock-event reasons (nvmlClocksEventReasons), by bit.
SW_POWER_CAP = 0x4  # set while the card holds its power limit
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    SW_POWER_CAP: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def _number(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None  # "[N/A]", "[Not Supported]"


def parse(lines) -> list[dict]:
  """nvidia-smi's CSV rows (timestamp, clocks.sm, power.draw, temperature.gpu, reasons) as dicts;
  rows that are not samples (an error line, a truncated last line) are skipped."""
  samples = []
  for line in lines:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5:
      continue
    sm, power, temp = (_number(f) for f in fields[1:4])
    try:
      reasons = int(fields[4], 16)
    except ValueError:
      continue
    if sm is None:
      continue
    samples.append({"sm_mhz": sm, "power_w": power, "temp_c": temp, "reasons": reasons})
  return samples


def _spread(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "n/a"
  return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def summarize(samples: list[dict], label: str = "") -> str:
  busy = [s for s in samples if s["reasons"] != 0x1]
  head = f"clocks{(' ' + label) if label else ''}: {len(samples)} samples, {len(busy)} busy"
  if not busy:
    return head + " (no busy sample: the step was shorter than the sampling period or failed)"
  counts = {}
  for s in busy:
    for bit, name in REASONS.items():
      if s["reasons"] & bit:
        counts[name] = counts.get(name, 0) + 1
    unknown = s["reasons"] & ~sum(REASONS)
    if unknown:
      counts[hex(unknown)] = counts.get(hex(unknown), 0) + 1
  reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
  temps = [s["temp_c"] for s in busy if s["temp_c"] is not None]
  hottest = f"{max(temps):.0f} C" if temps else "n/a"
  capped = [s for s in busy if s["reasons"] & SW_POWER_CAP]
  under_cap = (f"; under the power cap ({len(capped)} samples): SM MHz min/median/max "
               f"{_spread(s['sm_mhz'] for s in capped)}, power W "
               f"{_spread(s['power_w'] for s in capped)}") if capped else ""
  return (f"{head}; SM MHz min/median/max {_spread(s['sm_mhz'] for s in busy)}; "
          f"power W {_spread(s['power_w'] for s in busy)}; max temp {hottest}; "
          f"reasons (busy samples): {reasons or 'none'}{under_cap}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("csv", help="nvidia-smi's samples (the query above)")
  ap.add_argument("--label", default="", help="a name for the step sampled")
  args = ap.parse_args(argv)
  with open(args.csv) as f:
    print(summarize(parse(f), args.label))
  return 0


if __name__ == "__main__":
  sys.exit(main())
