"""The package's environment overrides, read one way: unset or empty gives the default, a value
of the right form is taken, anything else is refused by name (ValueError naming the variable,
what it takes and the value). An override that quietly ran its default voided a benchmark in
session 35; the C++ side's overrides parse the same way (ffi/heuristics/env_override.h)."""

from __future__ import annotations

import math
import os


def _raw(name: str) -> str | None:
  value = os.environ.get(name)
  return value if value else None


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
  """One of `choices` (exactly: no spaces, no case folding), else `default` when unset."""
  value = _raw(name)
  if value is None:
    return default
  if value not in choices:
    allowed = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
    raise ValueError(f"{name} must be {allowed}, got {value!r}")
  return value


def switch(name: str, default: bool) -> bool:
  """"1" on, "0" off, else `default` when unset."""
  value = choice(name, ("0", "1"), "1" if default else "0")
  return value == "1"


def positive_int(name: str, default: int | None, what: str = "a positive integer") -> int | None:
  """A decimal integer >= 1 (digits only), else `default` when unset."""
  value = _raw(name)
  if value is None:
    return default
  if not (value.isascii() and value.isdigit()) or int(value) < 1:
    raise ValueError(f"{name} must be {what}, got {value!r}")
  return int(value)


def positive_seconds(name: str, default: float) -> float:
  """A finite number of seconds > 0, else `default` when unset."""
  value = _raw(name)
  if value is None:
    return default
  try:
    seconds = float(value)
  except ValueError:
    seconds = math.nan
  if not 0 < seconds < math.inf:
    raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
  return seconds
