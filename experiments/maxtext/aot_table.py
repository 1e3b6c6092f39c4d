"""The table of `experiments.maxtext.aot`: bytes compiled, steps predicted.

Predictions use the H200 rates `experiments.device.predict_step` holds
(measured 2026-12-04): optax's 1B train step (0.225 s at batch 4, 1.01B
parameters; scaled here by the parameters and the batch), PCIe each way
(48.7 GiB/s), Grace Adam on 16 cores (5.4 Gparam/s) and host compute's
measured host-to-host copy rate (34 GiB/s). Per way:

- `stock`: optax's step;
- `maxtext_offload`: optax's step, plus the state's copies to the device
  before the update and back after it, on the critical path;
- superoffload `stream`: predict_step's model of its start/join program,
  from the compiled launches;
- superoffload `ffi` (host compute, the earlier default): its one host-compute
  call on the compute stream after the backward: the gradients' copies to
  the host, its host-to-host copies, the host step and the new weights'
  copies back, one after the other. A lower bound: the one GPU run of this
  design (the trainer's 1B step, 2026-12-04) took 1.93 s for its optimizer
  step, about three times what these parts add up to for it.
"""

from __future__ import annotations

from typing import Any

from experiments.device import predict_step

OPTAX_PARAMS = 1.01e9  # The model OPTAX_STEP_S was measured on.
HOST_COPY_BYTES_PER_S = 34 * 2**30  # Host compute's copies, measured.


def _gb(row: dict, direction: str) -> float:
  """GB a step moves: XLA's copies, and the stream executor's launches.

  The stream executor's copies are its own (staged by its launches, and
  its copies of the new weights back), not XLA's: taken from the
  compiled launches, less the parameters a steady step does not copy.
  """
  xla = row.get('copies', {}).get(direction, {}).get('bytes', 0)
  if not _streamed(row):
    return xla / 1e9
  if direction == 'D2H':
    xla += sum(
      s['staged'] - s.get('on_demand', 0) for s in row.get('stream_staging', [])
    )
  if direction == 'H2D':
    xla += sum(t['bytes'] for t in row.get('to_device', []))
  return xla / 1e9


def _streamed(row: dict) -> bool:
  """Whether the step is the stream executor's start/join program."""
  return bool(row.get('custom_calls', {}).get('jax_superoffload_stream_join'))


def _optax_s(params: int, batch: int) -> float:
  return predict_step.OPTAX_STEP_S[4] * batch / 4 * params / OPTAX_PARAMS


def predicted_s(row: dict, batch: int) -> float | None:
  """The predicted train step (seconds) of one compiled way."""
  params = row['num_params']
  optax_s = _optax_s(params, batch)
  link = predict_step.LINK_BYTES_PER_S
  if row['way'] == 'stock':
    return optax_s
  if row['way'] == 'maxtext_offload':
    return optax_s + (_gb(row, 'H2D') + _gb(row, 'D2H')) * 1e9 / link
  if _streamed(row):
    staged = {
      s['name']: s['staged'] - s.get('on_demand', 0)
      for s in row['stream_staging']
    }
    starts = [
      (c['backward_flops_before'], staged[c['name']])
      for c in row['optimizer_calls']
      if c['target'] not in predict_step._NOT_STARTS
    ]
    h2d = sum(t['bytes'] for t in row['to_device'])
    done = predict_step.predict(params, starts, h2d, batch, optax_s=optax_s)
    return done['stream_s']
  host_adam = params / predict_step.HOST_ADAM_PARAMS_PER_S
  fb = optax_s - predict_step.OPTAX_UPDATE_S
  link_s = (_gb(row, 'D2H') + _gb(row, 'H2D')) * 1e9 / link
  return fb + link_s + _gb(row, 'H2H') * 1e9 / HOST_COPY_BYTES_PER_S + host_adam


def table(results: list[dict], overrides: list[str]) -> dict[str, Any]:
  """The printed table and its rows (JSON), batch 4 and 8 predicted."""
  header = (
    '| way | device GB | host GB | to device GB | to host GB | host-host GB '
    '| compile s | predicted s, batch 4 (vs stock) |'
  )
  lines = [header, '|' + '---|' * 8]
  stock = next((r for r in results if r.get('way') == 'stock'), None)
  rows = []
  for r in results:
    name = r['way'] + (f' ({r["executor"]})' if r.get('executor') else '')
    if 'error' in r:
      lines.append(f'| {name} | failed: {r["error"].splitlines()[-1]} |')
      rows.append(r)
      continue
    pred = {b: predicted_s(r, b) for b in (4, 8)}
    ratio = (
      f' ({predicted_s(stock, 4) / pred[4]:.2f}x)'
      if stock and 'error' not in stock
      else ''
    )
    lines.append(
      f'| {name} | {r["device_GB"]:.2f} | {r["host_GB"]:.2f} '
      f'| {_gb(r, "H2D"):.2f} | {_gb(r, "D2H"):.2f} | {_gb(r, "H2H"):.2f} '
      f'| {r["compile_s"]} | {pred[4]:.3f}{ratio} |'
    )
    rows.append({**r, 'predicted_s': pred})
  text = '\n'.join(lines)
  if overrides:
    text += '\nMaxText overrides: ' + ' '.join(overrides)
  return {'text': text, 'rows': rows, 'overrides': overrides}
