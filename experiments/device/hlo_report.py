"""Reads an optimized, scheduled XLA:GPU module (HLO text) for the harness.

What it reports: the copies between device and host memory (memory space
`S(5)`) by direction with their bytes, and the host-to-host ones; every
custom call with the stream and queue it runs on; host-compute calls
(XLA's `HostExecute`); and the step's execution order with the GEMMs'
FLOPs, so that each optimizer call can be placed against the backward pass.
A while loop's body counts once per trip (its known trip count).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

_INSTR = re.compile(
  r'^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.*?) '
  r'(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$'
)
_ARRAY = re.compile(r'\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?')
_BYTES = {'pred': 1, 's4': 1, 'u4': 1, 'f8e4m3fn': 1, 'f8e5m2': 1}
_SKIP = {'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast'}
OPTIMIZER_TARGET = re.compile(r'jax_superoffload_')
HOST_MEMORY = 'S(5)'


def _itemsize(dtype: str) -> int:
  if dtype in _BYTES:
    return _BYTES[dtype]
  bits = re.search(r'(\d+)', dtype)
  return max(1, int(bits.group(1)) // 8) if bits else 4


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an HLO shape: dtype, dimensions, and whether on the host."""

  dtype: str
  dims: tuple[int, ...]
  on_host: bool

  @property
  def bytes(self) -> int:
    """Its size in bytes."""
    return math.prod(self.dims) * _itemsize(self.dtype)


def arrays(shape: str) -> list[Array]:
  """The arrays of a (possibly tuple) HLO shape string, in order."""
  out = []
  for m in _ARRAY.finditer(shape):
    dims = tuple(int(d) for d in m.group(2).split(',') if d)
    out.append(Array(m.group(1), dims, HOST_MEMORY in (m.group(3) or '')))
  return out


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction as printed: name, opcode, result shape, the rest."""

  name: str
  op: str
  shape: str
  rest: str  # Operands and attributes, as printed.

  def attr(self, key: str) -> str | None:
    """The value of attribute `key` (quotes and a leading % kept off)."""
    m = re.search(rf'\b{key}=("[^"]*"|%?[\w.\-]+|\{{[^}}]*\}})', self.rest)
    return m.group(1).strip('"') if m else None


def computations(hlo: str) -> dict[str, tuple[bool, list[Instr]]]:
  """Every computation: name -> (is the entry, its instructions in order)."""
  out = {}
  for block in re.split(r'\n(?=%|ENTRY )', hlo):
    head, _, body = block.partition('\n')
    m = re.match(r'(ENTRY )?%([\w.\-]+) ', head)
    if not (m and head.rstrip().endswith('{')):
      continue
    instrs = []
    for line in body.splitlines():
      i = _INSTR.match(line)
      if i:
        instrs.append(Instr(i['name'], i['op'], i['shape'], i['rest']))
    out[m.group(2)] = (bool(m.group(1)), instrs)
  return out


@dataclasses.dataclass(frozen=True)
class Event:
  """One executed instruction of interest, in execution order."""

  kind: str  # 'gemm', 'copy', 'optimizer', 'host_execute'
  name: str
  flops: float = 0.0  # GEMMs.
  backward: bool = False  # GEMMs of the backward pass.
  direction: str = ''  # Copies: 'D2H', 'H2D', 'H2H'.
  bytes: int = 0  # Copies.
  target: str = ''  # Custom calls.
  stream: str = '0'  # '0': the compute stream; else the annotated one.


class _Module:
  """A parsed module, with name lookups and GEMM FLOPs."""

  def __init__(self, hlo: str):
    self.comps = computations(hlo)
    self.shapes = {
      i.name: i.shape for _, instrs in self.comps.values() for i in instrs
    }

  def _dot(self, comp: str) -> Instr | None:
    for i in self.comps.get(comp, (False, []))[1]:
      if i.op == 'dot':
        return i
      called = i.attr('calls') if i.op == 'fusion' else None
      if called and (found := self._dot(called.lstrip('%'))):
        return found
    return None

  def gemm(self, i: Instr) -> tuple[float, bool] | None:
    """(FLOPs, is backward) of a GEMM instruction, else None."""
    if i.op == 'fusion':
      dot = self._dot((i.attr('calls') or '').lstrip('%'))
    elif i.op == 'dot':
      dot = i
    else:
      return None
    if dot is None:
      return None
    out = arrays(dot.shape)[0]
    lhs_name = re.match(r'\s*%([\w.\-]+)', dot.rest)
    lhs = arrays(self.shapes.get(lhs_name.group(1), '')) if lhs_name else []
    dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', dot.rest)
    k = 1
    if lhs and dims:
      k = math.prod(lhs[0].dims[int(d)] for d in dims.group(1).split(',') if d)
    backward = 'transpose(jvp' in (dot.attr('op_name') or '')
    return 2.0 * math.prod(out.dims) * k, backward

  def copy(self, i: Instr) -> tuple[str, int] | None:
    """(direction, bytes) of a copy touching host memory, else None."""
    if i.op not in ('copy', 'copy-start'):
      return None
    out = arrays(i.shape)
    src = re.match(r'\s*%([\w.\-]+)', i.rest)
    source = arrays(self.shapes.get(src.group(1), '')) if src else []
    if not out or not source:
      return None
    to_host, from_host = out[0].on_host, source[0].on_host
    if not (to_host or from_host):
      return None
    direction = {(True, True): 'H2H', (True, False): 'D2H'}.get(
      (to_host, from_host), 'H2D'
    )
    return direction, out[0].bytes


def _trips(i: Instr) -> int:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.rest)
  return int(m.group(1)) if m else 1


def _stream(i: Instr, inherited: str) -> str:
  m = re.search(r'_xla_stream_annotation="(\d+)"', i.rest)
  if m:
    return m.group(1)
  q = re.search(r'"operation_queue_id":"(\d+)"', i.rest)
  return q.group(1) if q and q.group(1) != '0' else inherited


def _on_host(i: Instr) -> bool:
  return 'host' in (i.attr('async_execution_thread') or '')


def _event(module: _Module, i: Instr, stream: str) -> Event | None:
  target = i.attr('custom_call_target') or ''
  if i.op in ('async-start', 'call-start', 'custom-call-start') and (
    _on_host(i) or target == 'HostExecute'
  ):  # Host compute: XLA:GPU runs it as HostExecute.
    return Event('host_execute', i.name, target='HostExecute', stream=stream)
  if i.op in ('custom-call', 'custom-call-start') and OPTIMIZER_TARGET.search(
    target
  ):
    return Event('optimizer', i.name, target=target, stream=stream)
  if (copy := module.copy(i)) is not None:
    return Event('copy', i.name, direction=copy[0], bytes=copy[1])
  if (gemm := module.gemm(i)) is not None:
    return Event('gemm', i.name, flops=gemm[0], backward=gemm[1])
  return None


def _calls_into(i: Instr) -> bool:
  """Whether `i` runs a computation whose events are the step's own.

  Calls and conditionals do; so does XLA:GPU's dynamic-slice fusion,
  which wraps a custom call whose operands are dynamic slices (a scanned
  layer's row) so that it reads them in place.
  """
  if i.op in ('call', 'call-start', 'conditional'):
    return not _on_host(i)
  return i.op == 'fusion' and '"dynamic_slice_fusion"' in i.rest


def _walk(module: _Module, comp: str, stream: str, out: list[Event]) -> None:
  for i in module.comps.get(comp, (False, []))[1]:
    if i.op in _SKIP:
      continue
    here = _stream(i, stream)
    if i.op == 'while':
      body = (i.attr('body') or '').lstrip('%')
      for _ in range(_trips(i)):
        _walk(module, body, here, out)
    elif _calls_into(i):
      for called in re.findall(
        r'(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)', i.rest
      ):
        _walk(module, called, here, out)
    elif (event := _event(module, i, here)) is not None:
      out.append(event)


def timeline(hlo: str) -> list[Event]:
  """The events of the entry computation in execution order."""
  module = _Module(hlo)
  entry = next(name for name, (is_entry, _) in module.comps.items() if is_entry)
  out: list[Event] = []
  _walk(module, entry, '0', out)
  return out


JOIN_TARGET = 'jax_superoffload_stream_join'
TO_DEVICE_TARGET = 'jax_superoffload_stream_to_device'


def _placement(events: list[Event], index: int, backward: float) -> dict:
  """Where event `index` sits: backward GEMMs and their FLOPs before it."""
  before = [e for e in events[:index] if e.kind == 'gemm' and e.backward]
  done = sum(e.flops for e in before)
  return {
    'backward_gemms_before': len(before),
    'backward_flops_before': round(done / backward, 4) if backward else None,
  }


def optimizer_calls(events: list[Event]) -> list[dict[str, Any]]:
  """Each optimizer call in order, placed against the backward's GEMMs.

  A call "waits" when the compute stream waits for the host step there:
  the join of a start/join program after a start, or, where there is no
  join, every bucket call (its host function runs on the compute stream)
  and every host-compute call (its done waits for the host step).
  """
  backward = sum(e.flops for e in events if e.kind == 'gemm' and e.backward)
  joined = any(e.target == JOIN_TARGET for e in events)
  started = False
  out = []
  for index, e in enumerate(events):
    if e.kind not in ('optimizer', 'host_execute'):
      continue
    # A join before the step's first start waits for nothing (the last
    # step's launches were joined in that step): it only hands the state
    # on, as overlap_scan's does before the backward loop.
    waits = (e.target == JOIN_TARGET and started) or not joined
    started = started or e.target not in (JOIN_TARGET, TO_DEVICE_TARGET)
    out.append(
      {
        'name': e.name,
        'target': e.target,
        'stream': e.stream,
        'waits': waits,
        **_placement(events, index, backward),
      }
    )
  return out


def copies(events: list[Event]) -> dict[str, dict[str, float]]:
  """Executed copies touching host memory by direction: count, bytes, GB."""
  out: dict[str, dict[str, float]] = {}
  for e in events:
    if e.kind == 'copy':
      row = out.setdefault(e.direction, {'count': 0, 'bytes': 0})
      row['count'] += 1
      row['bytes'] += e.bytes
      row['GB'] = round(row['bytes'] / 1e9, 3)
  return out


def custom_calls(hlo: str) -> dict[str, dict[str, int]]:
  """Every custom-call target: the streams (queues) it runs on, counted."""
  module = _Module(hlo)
  out: dict[str, collections.Counter] = {}
  for _, instrs in module.comps.values():
    for i in instrs:
      if i.op in ('custom-call', 'custom-call-start'):
        target = i.attr('custom_call_target') or '?'
        out.setdefault(target, collections.Counter())[_stream(i, '0')] += 1
  return {k: dict(v) for k, v in sorted(out.items())}


def memory_totals(memory: dict[str, int]) -> dict[str, float]:
  """Device and host GB: arguments + outputs - aliased + temporaries."""

  def total(prefix: str) -> float:
    get = lambda k: memory.get(f'{prefix}{k}_size_in_bytes', 0)  # noqa: E731
    return (get('argument') + get('output') - get('alias') + get('temp')) / 1e9

  return {
    'device_GB': round(total(''), 3),
    'host_GB': round(total('host_'), 3),
    'device_temp_GB': round(memory.get('temp_size_in_bytes', 0) / 1e9, 3),
    'host_temp_GB': round(memory.get('host_temp_size_in_bytes', 0) / 1e9, 3),
  }


def _operands(i: Instr) -> list[str]:
  return re.findall(r'%([\w.\-]+)', i.rest.split(')', 1)[0])


def _depends_on(by_name: dict[str, Instr], name: str, targets: set[str]):
  """Whether instruction `name` (transitively) reads one of `targets`."""
  seen, todo = set(), [name]
  while todo:
    n = todo.pop()
    if n in targets:
      return True
    if n in seen or n not in by_name:
      continue
    seen.add(n)
    todo.extend(_operands(by_name[n]))
  return False


def _in_host_memory(i: Instr) -> bool:
  return all(a.on_host for a in arrays(i.shape))


def reads_before_join(hlo: str) -> list[str]:
  """Instructions that read a joined optimizer call's results unjoined.

  A joined call (a module with stream joins) returns before its host step
  has run: what it returns may be read only through its join, after it
  (by an instruction that depends on that join, such as STV's validated
  step after the norm), or as a result of the step, which ends after every
  join. The joined results' copies to the device read them after the
  join, by their operands. So may a later start read results in host
  memory (a stack's re-seeded masters): its worker runs after the first's,
  in the order the side stream reached them. Returns the offenders' names.
  """
  through = {'get-tuple-element', 'bitcast', 'copy', 'copy-start', 'copy-done'}
  target = lambda i: i.attr('custom_call_target') or ''  # noqa: E731
  bad = []
  for _, instrs in computations(hlo).values():
    if not any(target(i) == JOIN_TARGET for i in instrs):
      continue
    by_name = {i.name: i for i in instrs}
    start_of: dict[str, str] = {}  # A start, or what passes its results.
    joins: dict[str, set[str]] = collections.defaultdict(set)
    readers = []
    for i in instrs:  # In order: a reader follows what it reads.
      name = target(i)
      is_start = OPTIMIZER_TARGET.match(name) and name not in (
        JOIN_TARGET,
        TO_DEVICE_TARGET,
      )
      if is_start:
        start_of[i.name] = i.name
      read = [n for n in _operands(i) if n in start_of]
      if is_start:  # Ordered after the start it reads, by its worker.
        read = [n for n in read if not _in_host_memory(by_name[n])]
      for start in {start_of[n] for n in read}:
        if target(i) == JOIN_TARGET:
          joins[start].add(i.name)
        elif i.op in through:
          start_of[i.name] = start
        elif i.op != 'tuple':
          readers.append((i.name, start))
    bad += [
      name
      for name, start in readers
      if not _depends_on(by_name, name, joins[start])
    ]
  return bad


def _aligned(nbytes: int, to: int = 256) -> int:
  return -(-nbytes // to) * to


# The bucket calls whose parameters (their last `num_leaves` device
# operands, after the gradients) are copied only when they changed, and
# the operands before their leaves (count, scalars and flags).
ON_DEMAND_PARAMS = {
  'jax_superoffload_adam_step_segments': 3,
  'jax_superoffload_adam_step_lowp_segments': 4,
  'jax_superoffload_adam_step_speculative': 4,
}
# A stack's re-seed before overlap_scan's loop: its stacked parameters
# (after the count, scalars, flag and stacked masters) are read on demand,
# a row at a time, through one row of staging.
RESEED_ROWS_TARGET = 'jax_superoffload_adam_reseed_rows'


def _aliased_results(i: Instr) -> set[int]:
  """The indices of call `i`'s results that alias one of its operands."""
  m = re.search(r'output_to_operand_aliasing=\{(.*?)\}(?:,\s*\w+=|$)', i.rest)
  if not m:
    return set()
  # A result that is not a tuple is output {}.
  return {int(x or 0) for x in re.findall(r'\{(\d*)\}:', m.group(1))}


def stream_staging(hlo: str) -> list[dict[str, int]]:
  """Per stream start: its slot bound and the device bytes it stages.

  The bound is the call's `staging_bytes` attribute; what it stages is
  every operand and result in device memory, each at the staging slots'
  256-byte alignment (xla_ffi/stream_context.h). A result aliased to a
  device operand is counted twice, so `staged` is an upper bound.
  `on_demand`: of those, the parameters of a re-seeding bucket call, which
  its worker copies only when they changed (weights_digest.py), and one
  row of a stack's re-seed, whose worker copies the rows in turn.
  `host_results`: the bytes of its results that alias no operand and that
  XLA placed in host memory (written there, not staged; XLA:GPU of
  jaxlib 0.12.0.1 placed the new weights so, that of 0.12.1 in device
  memory), at the same alignment.
  """
  module = _Module(hlo)
  out = []
  for _, instrs in module.comps.values():
    for i in instrs:
      bound = re.search(r'staging_bytes = (\d+)', i.rest)
      if i.op != 'custom-call' or not bound:
        continue
      names = _operands(i)
      device = lambda ns: [  # noqa: E731
        a for n in ns for a in arrays(module.shapes.get(n, '')) if not a.on_host
      ]
      results = [a for a in arrays(i.shape) if not a.on_host]
      staged = sum(_aligned(a.bytes) for a in device(names) + results)
      aliased = _aliased_results(i)
      host_results = sum(
        _aligned(a.bytes)
        for j, a in enumerate(arrays(i.shape))
        if a.on_host and j not in aliased
      )
      on_demand = _on_demand_bytes(i, names, device)
      if i.attr('custom_call_target') == RESEED_ROWS_TARGET:
        staged, on_demand = _reseed_rows_bytes(module, i, names, device)
      out.append(
        dict(
          name=i.name,
          target=i.attr('custom_call_target'),
          bound=int(bound[1]),
          staged=staged,
          on_demand=on_demand,
          host_results=host_results,
        )
      )
  return out


def _reseed_rows_bytes(module, i, names: list[str], device) -> tuple[int, int]:
  """A stack's re-seed: (bytes staged, of which on demand), one row's."""
  k = int(re.search(r'num_leaves = (\d+)', i.rest)[1])
  (first,) = arrays(module.shapes.get(names[3], ''))
  rows = first.dims[0]
  params = device(names[3 + k :])
  on_demand = sum(_aligned(a.bytes // rows) for a in params)
  scalars = sum(_aligned(a.bytes) for a in device(names[:3]))
  return scalars + on_demand, on_demand


def _on_demand_bytes(i, names: list[str], device) -> int:
  """The device bytes of call `i`'s parameters that it fetches on demand."""
  front = ON_DEMAND_PARAMS.get(i.attr('custom_call_target') or '')
  if front is None or not re.search(r'reseed = true', i.rest):
    return 0
  k = int(re.search(r'num_leaves = (\d+)', i.rest)[1])
  leaves = device(names[front:])
  return sum(_aligned(a.bytes) for a in leaves[-k:]) if k else 0


def to_device_calls(hlo: str) -> list[dict[str, Any]]:
  """Per copy-to-device call: its bytes, and where it reads and writes.

  Its CUDA handler copies host memory to device memory and refuses
  anything else, so every call must read host memory only (`from_host`)
  and write device memory only (`to_device`).
  """
  module = _Module(hlo)
  out = []
  for _, instrs in module.comps.values():
    for i in instrs:
      if i.attr('custom_call_target') != TO_DEVICE_TARGET:
        continue
      operands = [
        a for n in _operands(i) for a in arrays(module.shapes.get(n, ''))
      ]
      results = arrays(i.shape)
      out.append(
        dict(
          name=i.name,
          from_host=all(a.on_host for a in operands),
          to_device=not any(a.on_host for a in results),
          bytes=sum(a.bytes for a in results),
        )
      )
  return out


def summarize(hlo: str, memory: dict[str, int]) -> dict[str, Any]:
  """Everything the harness reports about one compiled step."""
  events = timeline(hlo)
  calls = optimizer_calls(events)
  # Host steps: a stack's re-seed (before the loop, a no-op unless the
  # parameters changed) starts no step.
  starts = [
    c
    for c in calls
    if c['target'] not in (JOIN_TARGET, TO_DEVICE_TARGET, RESEED_ROWS_TARGET)
  ]
  return {
    **memory_totals(memory),
    'copies': copies(events),
    'custom_calls': custom_calls(hlo),
    'host_execute_calls': sum(e.kind == 'host_execute' for e in events),
    'reads_before_join': reads_before_join(hlo),
    'stream_staging': stream_staging(hlo),
    'to_device': to_device_calls(hlo),
    'backward_gemms': sum(e.kind == 'gemm' and e.backward for e in events),
    'optimizer_calls': calls,
    'first_start_at': starts[0]['backward_flops_before'] if starts else None,
    'first_wait_at': next(
      (c['backward_flops_before'] for c in calls if c['waits']), None
    ),
  }
