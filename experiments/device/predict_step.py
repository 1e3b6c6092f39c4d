"""Predicts the 1B train step with the `stream` executor on the H200 machine.

  python -m experiments.device.predict_step AOT_JSON [scan [bfloat16]]

A model, to be checked on the next GPU, from two kinds of input:
- the compiled schedule (`experiments.device.aot`'s JSON of the `stream`
  step, unrolled by default, or scanned): the number of host steps started
  (buckets, or scanned layers' rows) and where each one starts, as the
  share of the backward's GEMM FLOPs issued before it;
- the rates measured on the H200 machine on 2026-12-04
  (`../shared/gpu-probes/`, docs/machines/h200.md): optax.adamw's train
  step, its optimizer-only step, PCIe each way, and Grace Adam on the
  host's 16 cores.

The step it models: the forward and backward as optax's less optax's
update; each host step's operands copied to pinned staging when it starts
(its gradients, and the parameters it re-seeds from: the compiled
launches' staged bytes, less a bucket's parameters, which in a steady
step are unchanged and not copied; `overlap_scan`'s rows copy theirs),
the compute stream waiting for that copy (so every copy is on the
critical path); the host steps one at a time (FIFO)
on the host's cores; at the join, the wait for the last host step, then
the new weights copied to the device (the compiled copies' bytes). The
backward is taken as 2/3 of the forward and backward (the share of GEMM
FLOPs the compiled step shows).
"""

from __future__ import annotations

import json
import pathlib
import sys

# Measured on the H200 machine, 2026-12-04.
OPTAX_STEP_S = {4: 0.225}  # The 1B train step, scanned, batch 4.
OPTAX_UPDATE_S = 0.007  # optax.adamw's optimizer-only step, 1.01B fp32.
LINK_BYTES_PER_S = 48.7 * 2**30  # PCIe, each way.
HOST_ADAM_PARAMS_PER_S = 67.1e6 / 12.4e-3  # Grace Adam, 16 cores.
BACKWARD_SHARE = 2 / 3


def predict(
  params: int,
  starts: list[tuple[float, int]],
  h2d_bytes: int,
  batch: int,
  serial: bool = False,
  optax_s: float | None = None,
) -> dict:
  """Seconds per step for `params` parameters in len(starts) host steps.

  `starts`: per host step, the share of the backward's GEMM FLOPs issued
  before it and the bytes it copies to the host (its gradients, and the
  parameters it re-seeds from); its parameters are taken in proportion to
  those bytes. `h2d_bytes`: the new weights copied back after the join.
  `serial`: the design before start/join, where the compute stream waits
  for each bucket's whole host step, not only its copy. `optax_s`: optax's
  step of this model at this batch (default: the measured 1B step, linear
  in the batch).
  """
  if optax_s is None:
    optax_s = OPTAX_STEP_S[4] * batch / 4  # Linear in the batch.
  fb = optax_s - OPTAX_UPDATE_S
  forward, backward = fb * (1 - BACKWARD_SHARE), fb * BACKWARD_SHARE
  total = sum(b for _, b in starts) or 1
  cpu_free, delay, d2h = 0.0, 0.0, 0.0
  for share, copied in sorted(starts):
    step_s = params * copied / total / HOST_ADAM_PARAMS_PER_S
    delay += copied / LINK_BYTES_PER_S  # The compute stream waits for it.
    d2h += copied / LINK_BYTES_PER_S
    if serial:
      delay += step_s
    ready = forward + share * backward + delay
    cpu_free = max(cpu_free, ready) + step_s
  compute_end = forward + backward + delay
  h2d = h2d_bytes / LINK_BYTES_PER_S
  step = max(compute_end, cpu_free) + h2d
  return {
    'design': 'serial' if serial else 'start/join',
    'batch': batch,
    'optax_s': round(optax_s, 4),
    'stream_s': round(step, 4),
    'vs_optax_tokens_per_s': round(optax_s / step, 3),
    'exposed_host_adam_s': round(max(0.0, cpu_free - compute_end), 4),
    'compute_stream_waits_s': round(delay, 4),
    'host_copies_s': round(d2h, 4),
    'weight_copies_s': round(h2d, 4),
  }


# Calls that start no host step: the joins, the copies after them, and
# overlap_scan's re-seeds before the loop (in a steady step each reads its
# flag and nothing else: its on-demand row is not copied).
_NOT_STARTS = (
  'jax_superoffload_stream_join',
  'jax_superoffload_stream_to_device',
  'jax_superoffload_adam_reseed_rows',
)


def main(argv: list[str]) -> int:
  rows = json.loads(pathlib.Path(argv[0]).read_text())
  layout = argv[1] if len(argv) > 1 else 'noscan'
  dtype = argv[2] if len(argv) > 2 else 'float32'
  case = next(
    r
    for r in rows
    if r.get('compiles')
    and r['fields']['optimizer'] == 'stream'
    and r['fields']['layout'] == layout
    and r['fields'].get('param_dtype', 'float32') == dtype
    and r['fields'].get('overlap_scan', True)
  )
  # In a steady step the parameters are unchanged: not copied.
  staged = {
    s['name']: s['staged'] - s.get('on_demand', 0)
    for s in case['stream_staging']
  }
  starts = [
    (c['backward_flops_before'], staged[c['name']])
    for c in case['optimizer_calls']
    if c['target'] not in _NOT_STARTS
  ]
  h2d = sum(t['bytes'] for t in case['to_device'])
  copied = sum(b for _, b in starts)
  print(
    f'{case["case"]}: {case["num_params"]} params, {len(starts)} host '
    f'steps, {copied / 1e9:.2f} GB to the host, {h2d / 1e9:.2f} GB back'
  )
  for serial in (True, False):
    for batch in (4, 8):
      print(json.dumps(predict(case['num_params'], starts, h2d, batch, serial)))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
