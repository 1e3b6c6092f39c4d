"""What machine a benchmark ran on: CPU model and vendor, ISA, threads.

Every benchmark records this beside its numbers, since a speed claim holds
for the CPU that measured it (AMD EPYC and Intel Xeon differ, for example,
in what a software prefetch hint does).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import jax

from jax_superoffload import kernels


def _cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo (empty elsewhere)."""
  fields: dict[str, str] = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if not line.strip():
          break
        key, _, value = line.partition(':')
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  return fields


def describe() -> dict[str, Any]:
  """The benchmark machine, as a JSON-ready dict."""
  info = _cpuinfo()
  flags = set(info.get('flags', info.get('Features', '')).split())
  return {
    'cpu_model': info.get('model name') or platform.processor() or 'unknown',
    'cpu_vendor': info.get('vendor_id') or info.get('CPU implementer', '?'),
    'cpus': os.cpu_count(),
    'simd': sorted(flags & {'avx2', 'avx512f', 'asimd', 'sve'}),
    'kernel_isa': kernels.instruction_set(),
    'kernel_prefetch': kernels.prefetch_policy(),
    'platform': platform.platform(),
    'jax': jax.__version__,
  }


def headline(machine: dict[str, Any]) -> str:
  """One line naming the machine, for a benchmark's printed table."""
  return (
    f'{machine["cpu_model"]} ({machine["cpu_vendor"]}), '
    f'{machine["cpus"]} cpus, kernel ISA {machine["kernel_isa"]}, '
    f'prefetch {machine["kernel_prefetch"]}, jax {machine["jax"]}'
  )
