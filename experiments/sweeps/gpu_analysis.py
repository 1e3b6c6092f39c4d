"""Pure helpers of `gpu_bench`: sizes, memory bytes, HLO copies, bisection.

Nothing here needs a GPU, so every piece is tested on CPU
(`tests/test_gpu_bench.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Everything the parts size; one instance for a GPU, one for dry runs."""

  exec_shapes: tuple[tuple[int, ...], ...]  # Leaves of the executor check.
  exec_steps: int
  model: dict[str, Any]  # Decoder fields of the train step.
  batch: int
  seq_len: int
  warmup: int
  steps: int  # Timed steps.
  bucket_mib: float  # superoffload bucket size.
  capacity_limit: int  # Device bytes the capacity search fits into.
  capacity_probes: int


def gpu_sizes(bytes_limit: int) -> Sizes:
  """About 1B parameters (12 * layers * 2048**2) where the device allows."""
  target = min(1.0e9, bytes_limit / 48)  # optax: 16 B/param + activations.
  width = 2048 if target >= 2e8 else 1024
  layers = max(1, round(target / (12 * width * width)))
  return Sizes(
    exec_shapes=((4096, 4096), (4096,), (1000, 1001), (3,)),
    exec_steps=5,
    model=dict(
      d_model=width,
      num_heads=width // 128,
      mlp_dim=4 * width,
      num_layers=layers,
      dtype='bfloat16',
    ),
    batch=4,
    seq_len=2048,
    warmup=2,
    steps=5,
    bucket_mib=256.0,
    capacity_limit=int(0.95 * bytes_limit),
    capacity_probes=7,
  )


DRY_SIZES = Sizes(
  exec_shapes=((48, 64), (64,), (1001,), (3,)),
  exec_steps=3,
  model=dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=2),
  batch=2,
  seq_len=16,
  warmup=1,
  steps=2,
  bucket_mib=0.01,
  capacity_limit=4 * 2**20,
  capacity_probes=4,
)


def superoffload_case(ffi_check: dict[str, Any]) -> str:
  """The decoder parts' superoffload case, after the "ffi" executor check.

  Where Grace Adam did not run (or not right) in this host compute, the
  decoder parts measure superoffload with "xla_host" rather than not at all.
  """
  if ffi_check.get('status') == 'ran' and ffi_check.get('match'):
    return 'superoffload'
  return 'superoffload:xla_host'


_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  'bf16': 2,
  'f16': 2,
  's16': 2,
  'u16': 2,
  'f32': 4,
  's32': 4,
  'u32': 4,
  'f64': 8,
  's64': 8,
  'u64': 8,
  'c64': 8,
  'c128': 16,
}
_ARRAY = re.compile(r'\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]')
_ASSIGN = re.compile(
  r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+'
  r'(?P<op>[\w\-]+)\((?P<operands>[^()]*)\)(?P<rest>.*)$'
)


def memory_bytes(stats: Any) -> dict[str, int] | None:
  """Device and host bytes a compiled step needs, from `memory_analysis()`.

  Each side is arguments + outputs - aliased (donated buffers counted once)
  + temporaries. On the CPU backend host memory is not told apart: the
  "host_*" fields are 0 and everything counts as device.
  """
  if stats is None:
    return None

  def side(prefix: str) -> int:
    get = lambda name: int(getattr(stats, f'{prefix}{name}_size_in_bytes', 0))  # noqa: E731
    return get('argument') + get('output') - get('alias') + get('temp')

  return {'device': side(''), 'host': side('host_')}


def memory_fields(stats: Any) -> dict[str, int] | None:
  """Every `*_size_in_bytes` field of a `memory_analysis()` result."""
  if stats is None:
    return None
  names = [n for n in dir(stats) if n.endswith('_size_in_bytes')]
  return {n: int(getattr(stats, n)) for n in names}


def array_bytes(shape: str) -> int:
  """Bytes of an HLO shape such as `f32[2048,6144]{1,0}` (tuples summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    count = math.prod(int(d) for d in dims.split(',') if d)
    total += count * _DTYPE_BYTES.get(dtype, 4)
  return total


def _entry_lines(hlo: str) -> list[str]:
  """The instructions of the ENTRY computation of an HLO module's text."""
  lines = hlo.splitlines()
  for i, line in enumerate(lines):
    if line.startswith('ENTRY'):
      body = []
      for inner in lines[i + 1 :]:
        if inner.startswith('}'):
          break
        body.append(inner)
      return body
  return []


def parameter_copies(hlo: str) -> dict[str, Any]:
  """The entry computation's copies of its own parameters.

  A donated parameter that XLA copies before updating it costs its size in
  memory and bandwidth each step. Counts plain `copy(param)` and the
  copy fusions XLA:GPU wraps them in (a fusion named `*copy*` of a single
  parameter).
  """
  params: dict[str, tuple[int, str]] = {}
  copies = []
  for line in _entry_lines(hlo):
    m = _ASSIGN.match(line)
    if not m:
      continue
    name, shape, op = m['name'], m['shape'], m['op']
    if op == 'parameter':
      params[name] = (int(m['operands'] or -1), shape)
      continue
    operands = [
      o.split()[-1].lstrip('%') for o in m['operands'].split(',') if o.strip()
    ]
    is_copy = op == 'copy' or (op == 'fusion' and 'copy' in name)
    if is_copy and len(operands) == 1 and operands[0] in params:
      index, _ = params[operands[0]]
      copies.append(
        {
          'parameter': index,
          'bytes': array_bytes(shape),
          'line': line.strip()[:200],
        }
      )
  param_bytes = sum(array_bytes(s) for _, s in params.values())
  return {
    'parameters': len(params),
    'parameter_bytes': param_bytes,
    'copies': len(copies),
    'copied_bytes': sum(c['bytes'] for c in copies),
    'examples': copies[:10],
  }


def _next_probe(probes: dict[int, int], lo: int, hi: int | None, limit: int):
  """The next layer count to probe.

  Where the line through the nearest probes meets `limit`, kept inside the
  bracket (the midpoint where that line says nothing new).
  """
  if hi is None:
    (n1, b1), (n2, b2) = sorted(probes.items())[-2:]
    slope = (b2 - b1) / (n2 - n1)
    guess = n2 + int((limit - b2) // slope) if slope > 0 else 2 * n2
    return min(max(guess, lo + 1), 64 * max(lo, 1))  # Grow at most 64x.
  if lo == 0:
    return hi // 2 if hi > 1 else 1
  guess = lo + int(
    (limit - probes[lo]) * (hi - lo) // (probes[hi] - probes[lo])
  )
  if lo < guess < hi:
    return guess
  return lo + 1 if guess <= lo else (lo + hi) // 2


def largest_fitting(
  measure: Callable[[int], int],
  limit: int,
  *,
  first: tuple[int, int] = (1, 2),
  max_probes: int = 10,
  deadline: float = math.inf,
  clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
  """The largest n >= 1 with `measure(n) <= limit`, by bracketing.

  `measure` (bytes a model of n layers needs) grows with n, about
  linearly, so each probe goes where the line through the nearest probes
  meets the limit (the bisection midpoint when that line leaves the
  bracket): with memory linear in layers, two probes past the `first` two
  close the bracket. Stops at `max_probes` or `deadline`: then `exact` is
  False and the answer is the bracket so far.
  """
  probes: dict[int, int] = {}
  lo, hi = 0, None  # lo fits (0: none known), hi does not (None: unknown).
  for n in first:
    if len(probes) >= max_probes or clock() >= deadline:
      break
    probes[n] = int(measure(n))
    if probes[n] <= limit:
      lo = max(lo, n)
    elif hi is None or n < hi:
      hi = n
  while len(probes) >= 2 and (hi is None or hi - lo > 1):
    if len(probes) >= max_probes or clock() >= deadline:
      break
    n = _next_probe(probes, lo, hi, limit)
    probes[n] = int(measure(n))
    if probes[n] <= limit:
      lo = n
    else:
      hi = n
  return {
    'largest': lo,
    'smallest_failing': hi,
    'exact': hi is not None and hi - lo == 1,
    'probes': dict(sorted(probes.items())),
  }
