"""Predicts a compiled 1B train step's time on the H200 machine.

  python -m experiments.device.predict_step AOT_JSON [CASE]
  python -m experiments.device.predict_step --calibrate AOT_JSON

A model, to be checked on the next GPU, from two kinds of input:
- the compiled program (`experiments.device.aot`'s JSON, read by
  hlo_report): the optimizer calls in execution order, each placed by the
  share of the backward's GEMM FLOPs issued before it; per call the copies
  its operands come through and its results go through, and what waits for
  each (`copies_in`, `copies_out`); host compute's results in device
  memory, which its done copies there; a stream start's staged bytes, and
  whether it holds its inputs (`hold_inputs`) and writes its new weights
  into its gradients' buffers (`weights_alias_grads`);
- the rates measured on the H200 machine on 2026-12-04 (the constants
  below, each with its source under results/gpu_h200/).

It plays the calls in order on four resources: the compute stream
(optax's forward and backward less its update, the GEMM work between two
calls in proportion to the FLOPs between them), the link each way, and
the host's cores (one host step at a time). XLA's copies of a call's
operands come before it and of its results after it: those `waited_by`
'compute' stall the compute stream, the others overlap it. A
host-compute call's done waits for its host step, then writes its device
results. A stream start copies its gradients to the host (the compute
stream waits for them unless the start holds its inputs), then its host
step runs, then, where its weights alias its gradients, its worker copies
them back; a join waits for the host steps (and copies back) started
before it; the copies to the device after a join (`to_device`) follow.
`--calibrate` plays the program of the design that ran on 2026-12-04
(`ffi`, host compute) and compares it with that run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any

# Measured on the H200 machine, 2026-12-04 (results/gpu_h200/).
# probes_2026-12-04/out-train_step.txt: optax.adamw's 1B step, scanned.
OPTAX_STEP_S = {4: 0.225}
# out-optimizer_step.txt: optax.adamw's optimizer-only step, 1.01B fp32.
OPTAX_UPDATE_S = 0.007
# out-optimizer_step.txt: a 1 GiB device_put each way.
D2H_BYTES_PER_S = 48.7 * 2**30
H2D_BYTES_PER_S = 48.9 * 2**30
LINK_BYTES_PER_S = D2H_BYTES_PER_S
# log.md, bench_adam: Grace Adam, 67.1M fp32 params in 12.4 ms, 16 cores.
HOST_ADAM_PARAMS_PER_S = 67.1e6 / 12.4e-3
# out-host_compute_profile.txt: 1,205.9 ms of MemcpyOther in 40 copies on
# the compute stream, in one `ffi` optimizer step of 20 fp32 leaves of
# 8192x6144; two copies a leaf, each a leaf's bytes, as the compiled `ffi`
# step's host-to-host copies are (two a leaf, the state's size twice).
H2H_BYTES_PER_S = 40 * 8192 * 6144 * 4 / 1.2059
# The backward's share of the forward and backward: that of the GEMM
# FLOPs the compiled 1B step shows.
BACKWARD_SHARE = 2 / 3

# What the calibration reproduces, as printed on 2026-12-04.
MEASURED = {
  # out-train_step.txt: optax, scanned, batch 4, median_step_s.
  'optax_step_s': 0.22521,
  # out-optimizer_step.txt: `ffi` at 1.01B fp32 parameters.
  'ffi_optimizer_step_s': 1.926,
  # out-train_step.txt: `ffi`, scanned, batch 4, median_step_s.
  'ffi_step_s': 1.99171,
  # out-train_step.txt: `ffi` 4,113 tokens/s against optax's 36,375.
  'ffi_vs_optax': 4113.0 / 36375.0,
}
# The model's error each way it may be trusted within.
TOLERANCE = 0.25

JOIN = 'jax_superoffload_stream_join'
TO_DEVICE = 'jax_superoffload_stream_to_device'
HOST_COMPUTE = 'HostExecute'
# Calls that start no host step: the joins, the copies after them, the
# claims of gradients before the starts that write over them, and
# overlap_scan's re-seeds before the loop (in a steady step each reads its
# flag and nothing else: its on-demand row is not copied).
_NOT_STARTS = (
  JOIN,
  TO_DEVICE,
  'jax_superoffload_adam_reseed_rows',
  'jax_superoffload_stream_claim',
)


@dataclasses.dataclass
class _Clock:
  """When each resource is next free (s), and what the step waits on."""

  compute: float = 0.0  # The compute stream.
  done_gemm_s: float = 0.0  # Its GEMM work issued so far.
  d2h: float = 0.0  # The link to the host.
  h2d: float = 0.0  # The link to the device.
  cpu: float = 0.0  # The host's cores.
  pending: list[float] = dataclasses.field(default_factory=list)  # Unjoined.
  tail: float = 0.0  # Work off the compute stream that the step ends after.
  # The compute stream's waits: for copies, and for host steps.
  waits: dict[str, float] = dataclasses.field(
    default_factory=lambda: {'copies': 0.0, 'host': 0.0}
  )
  # Seconds each copy direction and the host step take, wherever they run,
  # and the bytes each direction moves.
  busy: dict[str, float] = dataclasses.field(
    default_factory=lambda: dict.fromkeys(('D2H', 'H2D', 'H2H', 'host'), 0.0)
  )
  moved: dict[str, int] = dataclasses.field(
    default_factory=lambda: dict.fromkeys(('D2H', 'H2D', 'H2H'), 0)
  )

  def host_step(self, ready: float, params: float) -> float:
    """A host step of `params` parameters whose operands arrive at `ready`."""
    self.busy['host'] += params / HOST_ADAM_PARAMS_PER_S
    self.cpu = max(self.cpu, ready) + params / HOST_ADAM_PARAMS_PER_S
    return self.cpu

  def gemms_to(self, gemm_s: float) -> None:
    """The compute stream runs its GEMM work up to `gemm_s`."""
    self.compute += max(0.0, gemm_s - self.done_gemm_s)
    self.done_gemm_s = max(self.done_gemm_s, gemm_s)

  def wait(self, until: float, on: str = 'copies') -> None:
    """The compute stream waits until `until`, `on` copies or host steps."""
    self.waits[on] += max(0.0, until - self.compute)
    self.compute = max(self.compute, until)

  def copy(
    self, direction: str, nbytes: int, waited_by: str, early: bool = False
  ) -> float:
    """A copy; returns when it is done.

    'compute': the compute stream waits for it now; else it overlaps
    work, issued now or, `early` (an input copied while earlier work ran),
    as soon as its link was free.
    """
    issued = 0.0 if early and waited_by != 'compute' else self.compute
    rate = {'D2H': D2H_BYTES_PER_S, 'H2D': H2D_BYTES_PER_S}
    self.busy[direction] += nbytes / rate.get(direction, H2H_BYTES_PER_S)
    self.moved[direction] += nbytes
    if direction == 'H2H':  # Host memory to host memory: not the link.
      done = issued + nbytes / H2H_BYTES_PER_S
    else:
      link = direction.lower()
      done = max(issued, getattr(self, link)) + nbytes / rate[direction]
      setattr(self, link, done)
    if waited_by == 'compute':
      self.wait(done)
    else:
      self.tail = max(self.tail, done)
    return done


def _host_compute(clock: _Clock, call: dict, params: float, gemm_s) -> None:
  """XLA host compute: its host step, its done's wait and copy back."""
  clock.host_step(clock.compute, params)
  clock.gemms_to(gemm_s(call.get('done_backward_flops_before', 1.0)))
  clock.wait(clock.cpu, on='host')
  clock.copy('H2D', call.get('device_result_bytes', 0), 'compute')


def _start(
  clock: _Clock, call: dict, staged: int, params: float, fetched: int = 0
) -> None:
  """A stream start: its copies to the host, then its host step, FIFO.

  `fetched`: of `staged`, what its worker fetches when the step runs (a
  row of stacked gradients), which the compute stream never waits for.
  """
  waited_by = 'worker' if call.get('hold_inputs') else 'compute'
  copied = clock.copy('D2H', staged - fetched, waited_by)
  if fetched:
    copied = max(copied, clock.copy('D2H', fetched, 'worker'))
  end = clock.host_step(copied, params)
  if call.get('weights_alias_grads'):  # Its worker copies them back now.
    back_s = call['weights_bytes'] / H2D_BYTES_PER_S
    clock.busy['H2D'] += back_s
    clock.moved['H2D'] += call['weights_bytes']
    clock.h2d = max(clock.h2d, end) + back_s
    end = clock.h2d
  clock.pending.append(end)


def _work(case: dict) -> list[tuple[dict, int, int]] | None:
  """Per call, the bytes its host step reads from the device, and fetches.

  The second count is, of those bytes, what its worker fetches itself
  (`_start`).

  None where the program lacks what the model needs: host compute's
  copies (JSONs written before hlo_report recorded them).
  """
  # Not copied in: the weights' own stand-ins (written over gradients).
  staged = {
    s['name']: s['staged'] - s.get('on_demand', 0) - s.get('written_over', 0)
    for s in case.get('stream_staging', [])
  }
  fetched = {
    s['name']: s.get('fetched', 0) for s in case.get('stream_staging', [])
  }
  out = []
  for call in case['optimizer_calls']:
    if call['target'] == HOST_COMPUTE:
      if 'copies_in' not in call:
        return None
      nbytes = sum(c['bytes'] for c in call['copies_in'])
    elif call['target'] in _NOT_STARTS:
      nbytes = 0
    else:  # In a steady step the parameters are unchanged: not copied.
      nbytes = staged[call['name']]
    out.append((call, nbytes, fetched.get(call['name'], 0)))
  return out


def play(case: dict, fb_s: float) -> dict[str, float] | None:
  """Plays a compiled case's calls; `fb_s`: its forward and backward (s)."""
  work = _work(case)
  if work is None:
    return None
  forward = fb_s * (1 - BACKWARD_SHARE)
  gemm_s = lambda share: forward + share * fb_s * BACKWARD_SHARE  # noqa: E731
  total = sum(b for _, b, _ in work) or 1
  to_device = {t['name']: t['bytes'] for t in case.get('to_device', [])}
  clock = _Clock()
  for call, nbytes, fetched in work:
    clock.gemms_to(gemm_s(call['backward_flops_before']))
    for c in call.get('copies_in', []):  # XLA's copies of its operands.
      clock.wait(clock.copy(c['direction'], c['bytes'], c['waited_by'], True))
    params = case['num_params'] * nbytes / total
    if call['target'] == HOST_COMPUTE:
      _host_compute(clock, call, params, gemm_s)
    elif call['target'] == JOIN and call['waits'] and clock.pending:
      clock.wait(max(clock.pending), on='host')
      clock.pending = []
    elif call['target'] == TO_DEVICE:
      clock.copy('H2D', to_device.get(call['name'], 0), 'compute')
    elif call['target'] not in _NOT_STARTS:
      _start(clock, call, nbytes, params, fetched)
    for c in call.get('copies_out', []):  # XLA's copies of its results.
      clock.copy(c['direction'], c['bytes'], c['waited_by'])
  clock.gemms_to(fb_s)
  if not work:  # No host step: the update runs on the device.
    clock.compute += OPTAX_UPDATE_S
  step = max([clock.compute, clock.tail, *clock.pending])
  return {
    'step_s': step,
    'added_s': step - fb_s,  # To the forward and backward.
    'compute_stream_waits_s': sum(clock.waits.values()),
    **{f'waits_for_{k}_s': v for k, v in clock.waits.items()},
    **{f'{k}_s': v for k, v in clock.busy.items()},
    **{f'{k}_GB': v / 1e9 for k, v in clock.moved.items()},
  }


def optax_step_s(batch: int) -> float:
  """Optax.adamw's measured 1B step at `batch`, linear in the batch."""
  return OPTAX_STEP_S[4] * batch / 4


def predict_case(
  case: dict, batch: int, optimizer_only: bool = False
) -> dict | None:
  """A compiled case's predicted step at `batch`, against optax's.

  `optimizer_only`: the update alone (no forward and backward), as the
  2026-12-04 run timed it. None where the program lacks the model's inputs.
  """
  optax_s = optax_step_s(batch)
  fb_s = 0.0 if optimizer_only else optax_s - OPTAX_UPDATE_S
  played = play(case, fb_s)
  if played is None:
    return None
  return {
    'case': case.get('case'),
    'batch': batch,
    'optax_s': round(optax_s, 4),
    **{k: round(v, 4) for k, v in played.items()},
    'vs_optax': round(optax_s / played['step_s'], 3),
  }


def predict(
  params: int,
  starts: list[tuple[float, int]],
  h2d_bytes: int,
  batch: int,
  optax_s: float | None = None,
) -> dict:
  """Today's start/join design from its starts, without a compiled case.

  `starts`: per host step, the share of the backward's GEMM FLOPs issued
  before it and the bytes it copies to the host; `h2d_bytes`: the new
  weights copied back after the join. `optax_s`: optax's step of this
  model at this batch (default: the measured 1B step, linear in the batch).
  """
  calls = [
    {'name': f'start{n}', 'target': 'start', 'backward_flops_before': s}
    for n, (s, _) in enumerate(sorted(starts))
  ]
  case = {
    'num_params': params,
    'stream_staging': [
      {'name': c['name'], 'staged': b}
      for c, (_, b) in zip(calls, sorted(starts), strict=True)
    ],
    'optimizer_calls': [
      *calls,
      {'name': 'j', 'target': JOIN, 'waits': True, 'backward_flops_before': 1},
      {'name': 't', 'target': TO_DEVICE, 'backward_flops_before': 1},
    ],
    'to_device': [{'name': 't', 'bytes': h2d_bytes}],
  }
  if optax_s is None:
    optax_s = optax_step_s(batch)
  played = play(case, optax_s - OPTAX_UPDATE_S)
  return {'stream_s': round(played['step_s'], 4), **played}


def executor(case: dict) -> str | None:
  """The executor a case compiled (None: optax.adamw).

  JSONs written before the harness recorded it name it as the optimizer.
  """
  optimizer = case.get('fields', {}).get('optimizer')
  return case.get('executor', None if optimizer == 'optax' else optimizer)


def _find(rows: list[dict], name: str | None, layout: str = 'scan') -> dict:
  """The compiled fp32 1B case of executor `name` (None: optax)."""
  return next(
    r
    for r in rows
    if r.get('compiles')
    and executor(r) == name
    and r['fields']['layout'] == layout
    and r['fields'].get('param_dtype', 'float32') == 'float32'
  )


def calibrate(rows: list[dict]) -> list[dict[str, Any]]:
  """The 2026-12-04 run's measurements (MEASURED), predicted from `rows`.

  Its design: `ffi` (Grace Adam as XLA host compute), scanned, batch 4.
  The optimizer-only step is the compiled train step's host-compute call
  without the forward and backward: the run timed it on 20 leaves of
  8192x6144 (1.007B parameters, against the 1B's 1.008B), with the same
  copies a leaf as the compiled step's (the profile's 3 to the host, 2
  host to host and 1 back).
  """
  optax = predict_case(_find(rows, None), 4)
  ffi = predict_case(_find(rows, 'ffi'), 4)
  alone = predict_case(_find(rows, 'ffi'), 4, optimizer_only=True)
  got = {
    'optax_step_s': optax['step_s'],
    'ffi_optimizer_step_s': alone['step_s'],
    'ffi_step_s': ffi['step_s'],
    'ffi_vs_optax': optax['step_s'] / ffi['step_s'],
  }
  return [
    {
      'measurement': k,
      'measured': round(MEASURED[k], 4),
      'predicted': round(v, 4),
      'error': round(v / MEASURED[k] - 1, 3),
      'within': abs(v / MEASURED[k] - 1) <= TOLERANCE,
    }
    for k, v in got.items()
  ]


def predictable(case: dict) -> bool:
  """Whether the measured rates are this case's: the 1B on one H200."""
  fields = case.get('fields', {})
  return (
    bool(case.get('compiles'))
    and executor(case) in ('stream', 'ffi')
    and fields.get('gpu') == 'h200'
    and fields.get('preset') in ('1b', 'configs/1b.py')
    and fields.get('layers') is None
    and fields.get('devices', 1) == 1
    and all(k == 'dtype' for k, _ in fields.get('overrides', []))
  )


def rates() -> dict[str, float]:
  """The model's constants, in the units the sources print."""
  return {
    'optax_step_s': OPTAX_STEP_S[4],
    'optax_update_s': OPTAX_UPDATE_S,
    'd2h_GiB_per_s': D2H_BYTES_PER_S / 2**30,
    'h2d_GiB_per_s': H2D_BYTES_PER_S / 2**30,
    'host_adam_Gparam_per_s': round(HOST_ADAM_PARAMS_PER_S / 1e9, 3),
    'h2h_GB_per_s': round(H2H_BYTES_PER_S / 1e9, 3),
    'backward_share': round(BACKWARD_SHARE, 3),
  }


def load(path: str | pathlib.Path) -> list[dict]:
  """The compiled cases of an aot JSON: the harness's list, or a record's."""
  data = json.loads(pathlib.Path(path).read_text())
  return data['cases'] if isinstance(data, dict) else data


def main(argv: list[str]) -> int:
  if argv[:1] == ['--calibrate']:
    cases = load(argv[1])
    print(json.dumps({'rates': rates()}))
    for call in _find(cases, 'ffi')['optimizer_calls']:  # What it plays.
      print(json.dumps({k: v for k, v in call.items() if k != 'stream'}))
    alone = predict_case(_find(cases, 'ffi'), 4, optimizer_only=True)
    print(json.dumps({'optimizer_only': True, **alone}))
    results = calibrate(cases)
    for r in results:
      print(json.dumps(r))
    return 0 if all(r['within'] for r in results) else 1
  for case in load(argv[0]):
    if not predictable(case) or (argv[1:] and argv[1] not in case['case']):
      continue
    for batch in (4, 8):
      print(json.dumps(predict_case(case, batch)))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
