"""Reads an optimized, scheduled XLA:GPU module (HLO text) for the harness.

What it reports: the copies between device and host memory (memory space
`S(5)`) by direction with their bytes, and the host-to-host ones; every
custom call with the stream and queue it runs on; host-compute calls
(XLA's `HostExecute`); and the step's execution order with the GEMMs'
FLOPs, so that each optimizer call can be placed against the backward pass;
per call, the copies it waits for or makes and what waits for them, and
what a stream start holds and aliases (`call_facts`): what
`predict_step` plays. A while loop's body counts once per trip (its known
trip count).
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

  kind: str  # 'gemm', 'copy', 'optimizer', 'host_execute', 'host_done'
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
    self.by_name = {
      i.name: i for _, instrs in self.comps.values() for i in instrs
    }
    self.shapes = {name: i.shape for name, i in self.by_name.items()}

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


_DONES = ('async-done', 'call-done', 'custom-call-done')


def _host_start(i: Instr) -> bool:
  """Whether `i` starts host compute (XLA:GPU runs it as HostExecute)."""
  return i.op in ('async-start', 'call-start', 'custom-call-start') and (
    _on_host(i) or i.attr('custom_call_target') == 'HostExecute'
  )


def _event(module: _Module, i: Instr, stream: str) -> Event | None:
  target = i.attr('custom_call_target') or ''
  if _host_start(i):
    return Event('host_execute', i.name, target='HostExecute', stream=stream)
  if i.op in _DONES:  # Where the compute stream waits for a host step.
    start = module.by_name.get(next(iter(_operands(i)), ''))
    if start is not None and _host_start(start):
      return Event('host_done', start.name, target='HostExecute')
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
# Hands gradient buffers over to the new weights a start writes over them
# (`weights_over_grads`); it starts no host step and waits for nothing.
CLAIM_TARGET = 'jax_superoffload_stream_claim'


def _placement(events: list[Event], index: int, backward: float) -> dict:
  """Where event `index` sits: backward GEMMs and their FLOPs before it."""
  before = [e for e in events[:index] if e.kind == 'gemm' and e.backward]
  done = sum(e.flops for e in before)
  return {
    'backward_gemms_before': len(before),
    'backward_flops_before': round(done / backward, 4) if backward else None,
  }


def _done_at(events: list[Event], index: int, backward: float) -> float:
  """Where the compute stream waits for host compute `index`: its done."""
  done = next(
    (
      j
      for j in range(index, len(events))
      if events[j].kind == 'host_done' and events[j].name == events[index].name
    ),
    index,
  )
  return _placement(events, done, backward)['backward_flops_before']


def optimizer_calls(events: list[Event]) -> list[dict[str, Any]]:
  """Each optimizer call in order, placed against the backward's GEMMs.

  A call "waits" when the compute stream waits for the host step there:
  the join of a start/join program after a start, or, where there is no
  join, every bucket call (its host function runs on the compute stream)
  and every host-compute call (its done waits for the host step, at
  `done_backward_flops_before`).
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
    # A claim runs nothing: a join after claims alone waits for nothing.
    started = started or e.target not in (
      JOIN_TARGET,
      TO_DEVICE_TARGET,
      CLAIM_TARGET,
    )
    call = {
      'name': e.name,
      'target': e.target,
      'stream': e.stream,
      'waits': waits,
      **_placement(events, index, backward),
    }
    if e.kind == 'host_execute':
      call['done_backward_flops_before'] = _done_at(events, index, backward)
    out.append(call)
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


def written_copies(hlo: str) -> list[str]:
  """Copies XLA made of a stacked gradient that row steps write over.

  A row step with `weights_over_grads` hands its stacked gradient on
  (aliased), and its worker later copies the row's new weights into that
  buffer: XLA must carry the very buffer through the rest of the loop and
  to the join that passes it on (`grace_adam.written_rows`). A copy of
  it, in the loop's body or between the loop and that join, would leave
  the worker writing where nothing reads (and the join handing on rows
  not yet written). Returns the names of such copies: in a computation
  holding such row steps, any copy shaped like one's results; elsewhere,
  a copy on the way from a loop's results to a join's operand.
  """
  module = _Module(hlo)
  target = lambda i: i.attr('custom_call_target') or ''  # noqa: E731
  over = re.compile(r'\bweights_over_grads = true\b')
  kinds = lambda i: {(a.dtype, a.dims) for a in arrays(i.shape)}  # noqa: E731
  shapes: set = set()
  bad = []
  for _, instrs in module.comps.values():
    mine = set().union(
      *(
        kinds(i)
        for i in instrs
        if target(i) == ROW_TARGET and over.search(i.rest)
      )
    )
    shapes |= mine
    bad += [i.name for i in instrs if i.op == 'copy' and kinds(i) & mine]
  for i in module.by_name.values():
    if target(i) != JOIN_TARGET:
      continue
    for name in _operands(i):
      source = module.by_name.get(name)
      while source is not None and source.op in ('bitcast', 'copy'):
        if source.op == 'copy' and kinds(source) & shapes:
          bad.append(source.name)
        source = module.by_name.get(_operands(source)[0])
  return bad


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
        CLAIM_TARGET,
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
# A row step with results reads the stacked gradients it passes on (held
# by XLA until the join): its worker fetches the row, on demand.
ROW_TARGET = 'jax_superoffload_adam_step_row'


def _aliasing(i: Instr) -> dict[int, int]:
  """Call `i`'s aliased results: result index -> operand index."""
  m = re.search(r'output_to_operand_aliasing=\{(.*?)\}(?:,\s*\w+=|$)', i.rest)
  if not m:
    return {}
  # A result that is not a tuple is output {}.
  pairs = re.findall(r'\{(\d*)\}:\s*\((\d+),', m.group(1))
  return {int(r or 0): int(o) for r, o in pairs}


def _aliased_results(i: Instr) -> set[int]:
  """The indices of call `i`'s results that alias one of its operands."""
  return set(_aliasing(i))


def stream_staging(hlo: str) -> list[dict[str, int]]:
  """Per stream start: its slot bound and the device bytes it stages.

  The bound is the call's `staging_bytes` attribute; what it stages is
  every operand and result in device memory, each at the staging slots'
  256-byte alignment (xla_ffi/stream_context.h). A result aliased to a
  device operand is counted twice, so `staged` is an upper bound.
  `on_demand`: of those, the parameters of a re-seeding bucket call, which
  its worker copies only when they changed (weights_digest.py), and one
  row of a stack's re-seed, whose worker copies the rows in turn.
  `fetched`: of those, the rows of the stacked gradients a row step reads
  (`_held_row_bytes`), which its worker fetches.
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
      # The weights written over claimed gradients: a stand-in of their own.
      written_over = sum(_aligned(b) for b in _claimed(module, i))
      staged += written_over
      fetched = 0
      if i.attr('custom_call_target') == RESEED_ROWS_TARGET:
        staged, on_demand = _reseed_rows_bytes(module, i, names, device)
      elif _fetches_rows(i):
        staged, fetched = _held_row_bytes(i, names, device)
      out.append(
        dict(
          name=i.name,
          target=i.attr('custom_call_target'),
          bound=int(bound[1]),
          staged=staged,
          on_demand=on_demand,
          written_over=written_over,
          host_results=host_results,
          fetched=fetched,
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


def _fetches_rows(i) -> bool:
  """Whether call `i` is a row step of stacked gradients (it has results)."""
  return i.attr('custom_call_target') == ROW_TARGET and bool(arrays(i.shape))


# A row step's operands before its leaves': the count, the scalars, the row.
_ROW_FRONT = 3


def _row_grads(i, names: list[str], device) -> list:
  """Row step `i`'s gradient operands in device memory (`device`'s)."""
  k = int(re.search(r'num_leaves = (\d+)', i.rest)[1])
  return device(names[_ROW_FRONT + 3 * k : _ROW_FRONT + 4 * k])


def _held_row_bytes(i, names: list[str], device) -> tuple[int, int]:
  """A row step of stacked gradients: (bytes staged, of which fetched).

  Its count and scalars in device memory (held until the join, copied by
  its worker: `hold_inputs`), its row cursor in host memory (not staged);
  its worker fetches one row of each stacked gradient when the step runs.
  """
  grads = _row_grads(i, names, device)
  fetched = sum(_aligned(a.bytes // a.dims[0]) for a in grads)
  scalars = sum(_aligned(a.bytes) for a in device(names[:_ROW_FRONT]))
  return scalars + fetched, fetched


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


# What a call's operands or results pass through on their way from or to a
# copy: nothing runs for these on the compute stream.
_PASS = {'bitcast', 'get-tuple-element', 'tuple', 'copy-done', *_DONES}
# What the compute stream may meet between a copy's start and its done and
# still wait for the copy before any work of its own.
_NO_WORK = _SKIP | {'copy-start', 'copy-done'}
_HOLD_INPUTS = re.compile(r'\bhold_inputs = (true|false)\b')
_NOT_STARTS = (JOIN_TARGET, TO_DEVICE_TARGET, RESEED_ROWS_TARGET, CLAIM_TARGET)


def _is_call(i: Instr) -> bool:
  """Whether `i` is an optimizer call or a host-compute start."""
  target = i.attr('custom_call_target') or ''
  return _host_start(i) or (
    i.op in ('custom-call', 'custom-call-start')
    and bool(OPTIMIZER_TARGET.search(target))
  )


def _copy_streams(module: _Module) -> dict[str, str]:
  """Per copy touching host memory: what waits for it.

  'compute': a synchronous copy (the compute stream runs it), or a
  copy-start whose done comes before any work (the compute stream waits
  for it at once); 'copy': work is scheduled between its start and its
  done, which the copy overlaps.
  """
  out = {}
  for _, instrs in module.comps.values():
    done_at = {
      _operands(j)[0]: k for k, j in enumerate(instrs) if j.op == 'copy-done'
    }
    for n, i in enumerate(instrs):
      if module.copy(i) is None:
        continue
      done = done_at.get(i.name, len(instrs)) if i.op != 'copy' else n
      busy = any(j.op not in _NO_WORK for j in instrs[n + 1 : done])
      out[i.name] = 'copy' if busy else 'compute'
  return out


def _upstream(module: _Module, name: str) -> tuple[list[str], list[str]]:
  """(calls, host copies) that `name` reads through `_PASS` ops and copies.

  The walk stops at a call: a copy before it is that call's own.
  """
  seen, todo = set(), list(_operands(module.by_name[name]))
  calls, copies = [], []
  while todo:
    n = todo.pop()
    i = module.by_name.get(n)
    if n in seen or i is None:
      continue
    seen.add(n)
    if _is_call(i):
      calls.append(n)
    elif module.copy(i) is not None:
      copies.append(n)
      todo.extend(_operands(i))
    elif i.op in _PASS:
      todo.extend(_operands(i))
  return calls, copies


def _grouped(module: _Module, names: list[str], streams: dict) -> list[dict]:
  """Copies summed by direction and by what waits for them."""
  groups: dict[tuple[str, str], list[int]] = {}
  for n in names:
    direction, nbytes = module.copy(module.by_name[n])
    row = groups.setdefault((direction, streams[n]), [0, 0])
    row[0] += 1
    row[1] += nbytes
  return [
    {'direction': d, 'waited_by': w, 'count': c, 'bytes': b}
    for (d, w), (c, b) in sorted(groups.items())
  ]


def _device_results(module: _Module, start: Instr) -> dict[str, int]:
  """Host compute's results in device memory: its done copies them there."""
  done = next(
    (
      i
      for i in module.by_name.values()
      if i.op in _DONES and _operands(i)[:1] == [start.name]
    ),
    None,
  )
  shape = done.shape if done is not None else ''
  return {
    'device_result_bytes': sum(a.bytes for a in arrays(shape) if not a.on_host)
  }


def _start_facts(module: _Module, i: Instr) -> dict[str, Any]:
  """A stream start's `hold_inputs`, and its weights aliased to gradients.

  Its weights: results in device memory aliasing one of its device
  operands after the front ones (count, scalars, flags): the gradients'
  buffers, which receive the new weights; or, with `weights_over_grads`,
  the claimed gradients it reads (`_claimed`), which it writes over, or,
  for a row step of stacked gradients, the row of each it fetched.
  """
  target = i.attr('custom_call_target') or ''
  if target in _NOT_STARTS:
    return {}
  names, results = _operands(i), arrays(i.shape)
  front = ON_DEMAND_PARAMS.get(target, 0)
  weights = 0
  over = bool(re.search(r'\bweights_over_grads = true\b', i.rest))
  if _fetches_rows(i):
    # Its results are the stacked gradients it holds; with the weights
    # over them, its worker copies a row of each back.
    if over:
      device = lambda ns: [  # noqa: E731
        a for n in ns for a in arrays(module.shapes.get(n, '')) if not a.on_host
      ]
      weights = sum(a.bytes // a.dims[0] for a in _row_grads(i, names, device))
  else:
    for r, o in _aliasing(i).items():
      operand = (
        arrays(module.shapes.get(names[o], '')) if o < len(names) else []
      )
      on_device = r < len(results) and not results[r].on_host
      if o >= front and on_device and operand and not operand[0].on_host:
        weights += results[r].bytes
    weights += sum(_claimed(module, i))
  hold = _HOLD_INPUTS.search(i.rest)
  return {
    'hold_inputs': bool(hold) and hold[1] == 'true',
    'weights_alias_grads': weights > 0,
    'weights_bytes': weights,
  }


def _claimed(module: _Module, i: Instr) -> list[int]:
  """The bytes of each claimed gradient a start writes its weights over.

  Those of its operands that a stream claim produced, where its
  backend_config says `weights_over_grads = true`; none elsewhere.
  """
  if not re.search(r'\bweights_over_grads = true\b', i.rest):
    return []
  out = []
  for name in _operands(i):
    source = module.by_name.get(name)
    while source is not None and source.op in ('get-tuple-element', 'bitcast'):
      source = module.by_name.get(_operands(source)[0])
    if source is not None and source.attr('custom_call_target') == CLAIM_TARGET:
      out += [a.bytes for a in arrays(module.shapes.get(name, ''))]
  return out


def call_facts(hlo: str) -> dict[str, dict[str, Any]]:
  """Per optimizer call (by name): its copies, and what a start holds.

  `copies_in`: the copies touching host memory its operands come through;
  `copies_out`: those copying its results (a copy is the output of the
  call it reads, never also the input of the next); each summed by
  direction and `waited_by` (_copy_streams). Host compute adds
  `device_result_bytes`; a stream start `hold_inputs` (its backend_config;
  absent: false, the compute stream waits for the start's copies to the
  host), `weights_alias_grads` and `weights_bytes` (_start_facts).
  """
  module = _Module(hlo)
  streams = _copy_streams(module)
  out_of: dict[str, list[str]] = collections.defaultdict(list)
  for name in streams:
    calls, _ = _upstream(module, name)
    if calls:
      out_of[calls[0]].append(name)
  copied_out = {n for names in out_of.values() for n in names}
  facts = {}
  for name, i in module.by_name.items():
    if not _is_call(i):
      continue
    _, copies = _upstream(module, name)
    facts[name] = {
      'copies_in': _grouped(
        module, [c for c in copies if c not in copied_out], streams
      ),
      'copies_out': _grouped(module, out_of[name], streams),
      **(
        _device_results(module, i)
        if _host_start(i)
        else _start_facts(module, i)
      ),
    }
  return facts


def summarize(hlo: str, memory: dict[str, int]) -> dict[str, Any]:
  """Everything the harness reports about one compiled step."""
  events = timeline(hlo)
  facts = call_facts(hlo)
  calls = [{**c, **facts.get(c['name'], {})} for c in optimizer_calls(events)]
  # Host steps: a stack's re-seed (before the loop, a no-op unless the
  # parameters changed) starts no step.
  starts = [c for c in calls if c['target'] not in _NOT_STARTS]
  return {
    **memory_totals(memory),
    'copies': copies(events),
    'custom_calls': custom_calls(hlo),
    'host_execute_calls': sum(e.kind == 'host_execute' for e in events),
    'reads_before_join': reads_before_join(hlo),
    'written_copies': written_copies(hlo),
    'stream_staging': stream_staging(hlo),
    'to_device': to_device_calls(hlo),
    'backward_gemms': sum(e.kind == 'gemm' and e.backward for e in events),
    'optimizer_calls': calls,
    'first_start_at': starts[0]['backward_flops_before'] if starts else None,
    'first_wait_at': next(
      (c['backward_flops_before'] for c in calls if c['waits']), None
    ),
  }
