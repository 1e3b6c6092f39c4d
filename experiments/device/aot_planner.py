"""The planner's prediction for a step the harness compiles.

  python -m experiments.device.aot_planner AOT_JSON [AOT_JSON ...]
  python -m experiments.device.aot_planner --table AOT_JSON [AOT_JSON ...]

prints it beside each compiled case of `experiments.device.aot`'s JSONs
(or a capacity cache's), with the device error; `--table` as Markdown,
with the host bytes and error too.

`predict` asks `jax_superoffload.plan` about the trainer's step of a case:
the same model (`planner_spec`: its shape, activations' and weights'
dtypes), the trainer's policies, and the GPU's budgets from `gpu_targets`
with no reserve (`planner_profile`), so that its device bytes, host bytes
and fit stand beside the compiled ones. `outside_model` says which cases
are not the program the planner models, and why.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any

import jax_superoffload as superoffload
from experiments.device import aot_steps
from experiments.device import gpu_targets
from experiments.trainer import config as config_lib


def planner_profile(gpu: str) -> superoffload.HardwareProfile:
  """The planner's profile of `gpu` with the harness's budgets, no reserve."""
  base = {
    'h100': superoffload.H100_PCIE,
    'h200': superoffload.H200_PCIE,
    'gh200': superoffload.GH200,
  }[gpu]
  target = gpu_targets.TARGETS[gpu]
  return dataclasses.replace(
    base,
    name=f'{target.name}, {target.host}',
    device_memory_gb=target.budget_bytes / 1e9,
    host_memory_gb=target.host_bytes / 1e9,
    device_memory_reserve=0.0,
    host_memory_reserve=0.0,
  )


def planner_spec(cfg: config_lib.Config, params: int) -> superoffload.ModelSpec:
  """The trainer's model as the planner sees it.

  bf16 or fp32 activations as `cfg.dtype` and weights (and so gradients)
  as `cfg.param_dtype`; checkpointed when the layers are scanned
  (`weight_flow_scan` rematerializes each block, keeping its input);
  attention as `jax.nn.dot_product_attention` computes it by default, with
  its scores materialized (not flash attention).
  """
  return superoffload.ModelSpec(
    params=params,
    layers=cfg.num_layers,
    hidden=cfg.d_model,
    seq_len=cfg.seq_len,
    batch=cfg.batch_size,
    heads=cfg.num_heads,
    vocab=cfg.vocab_size,
    bytes_per_activation=2 if cfg.dtype != 'float32' else 4,
    bytes_per_param=2 if cfg.param_dtype != 'float32' else 4,
    activation_checkpointing=cfg.scan_layers,
    flash_attention=False,
  )


def predict(cfg: config_lib.Config, params: int, gpu: str) -> dict[str, Any]:
  """The planner's device bytes, host bytes and fit for the trainer's step.

  optax's step is the planner's device-resident Adam reference; the
  superoffload step is the plan with the trainer's policies: its weights
  policy, cast side, bucket size, device buckets, moments, and STV armed
  when it clips or skips non-finite steps. `host` is what XLA counts: the
  plan's host bytes less the staging slots the library allocates itself
  (`staging`); `fits` is the plan's, with them.
  """
  spec, hw = planner_spec(cfg, params), planner_profile(gpu)
  if cfg.device_buckets:
    raise ValueError(
      f'device_buckets={cfg.device_buckets}: the comparison covers the '
      "trainer's default, no device buckets"
    )
  if cfg.optimizer == 'optax':
    p = superoffload.plan(spec, hw, moments='fp32').device_adam
    return dict(device=p.device_bytes, host=0.0, staging=0.0, fits=p.fits)
  bucket = 'auto'
  if cfg.bucket_mib is not None:
    bucket = int(cfg.bucket_mib * 2**20) // 4
  p = superoffload.plan(
    spec,
    hw,
    weights=cfg.weights_policy,
    cast=cfg.cast,
    bucket_elements=bucket,
    device_buckets=0,
    stv=cfg.clip_norm is not None or cfg.skip_nonfinite,
    moments=cfg.moments,
  )
  return dict(
    device=p.device_bytes,
    host=p.host_bytes - p.staging_bytes,
    staging=p.staging_bytes,
    fits=p.fits,
  )


def outside_model(result: dict[str, Any]) -> str | None:
  """Why a compiled case is not the program the planner models, or None.

  The planner models optax.adamw as mixed-precision Adam on the device and
  superoffload as the `stream` executor with its host steps after the
  backward pass, writing the new weights over their gradients.
  """
  cfg = trainer_config(result['fields'])
  executor = result.get('executor')
  sixteen = cfg.param_dtype != 'float32'
  if cfg.optimizer == 'optax':
    if sixteen:
      return (
        'optax.adamw on 16-bit weights keeps no fp32 master and 16-bit '
        "moments (8 B/param); the planner's device Adam is mixed precision "
        '(16 B/param)'
      )
    return None
  if executor in ('ffi', 'xla_host'):
    return (
      'host compute: XLA stages the state through host buffers of its own '
      '(the planner models the stream executor)'
    )
  if executor == 'device' or cfg.optimizer == 'device':
    return 'the device executor copies the state to the device to update it'
  if sixteen and cfg.scan_layers and cfg.overlap_scan:
    return (
      "overlap_scan's rows return each 16-bit stack's fp32 master to the "
      'device and no 16-bit weights through the host (rounding them on '
      'the host is not built)'
    )
  if sixteen and cfg.cast == 'device':
    return (
      'casting on the device: the planner counts a bucket each way in fp32 '
      'in device memory, which this step casts after the backward pass, '
      "under its activations' peak"
    )
  calls = result.get('to_device') or []
  if sixteen and cfg.cast == 'host' and calls and not calls[0]['from_host']:
    return (
      "this XLA places the host steps' new 16-bit weights in device memory "
      '(the planner: in host memory, as the 0.12.0.1 plugin does)'
    )
  return None


def trainer_config(fields: dict[str, Any]) -> config_lib.Config:
  """The trainer's config of a case given as its JSON fields."""
  case = aot_steps.Case(
    **{**fields, 'overrides': tuple(map(tuple, fields['overrides']))}
  )
  return aot_steps.trainer_config(case)


def label(result: dict[str, Any]) -> str:
  """The case's name; where it sets its layers, its shape and GPU too.

  The shape: width / heads / MLP width, then sequence x batch.
  """
  fields = result['fields']
  if fields.get('layers') is None:
    return result['case']
  c = trainer_config(fields)
  return (
    f'{result["case"]} x{c.num_layers} {c.d_model}/{c.num_heads}/'
    f'{c.mlp_dim} {c.seq_len}x{c.batch_size} on {fields["gpu"]}'
  )


def compiled_cases(path: str) -> list[dict[str, Any]]:
  """The compiled cases of a results JSON (`aot`'s, or a capacity cache)."""
  rows = json.loads(pathlib.Path(path).read_text())
  if isinstance(rows, dict):  # A results file: the cases and their context.
    rows = rows.get('cases') or rows.get('compiles', [])
  out = []
  for r in rows:
    if r.get('compiles'):
      # Compiled before the harness had the field, when scanned steps
      # started their host steps after the loop.
      fields = {'overlap_scan': False, **r['fields']}
      out.append({**r, 'fields': fields})
  return out


def compare(result: dict[str, Any]) -> dict[str, Any]:
  """One compiled case beside the planner: bytes, errors, why outside."""
  cfg = trainer_config(result['fields'])
  p = predict(cfg, result['num_params'], result['fields']['gpu'])
  memory = result['memory']
  device, host = (
    sum(memory.get(f'{prefix}{k}_size_in_bytes', 0) * sign for k, sign in _SUM)
    for prefix in ('', 'host_')
  )
  host -= returned_through_host(result)
  return dict(
    label=label(result),
    jax=result.get('jax', ''),
    device=device,
    host=host,
    planner_device=p['device'],
    planner_host=p['host'],
    device_error=p['device'] / device - 1,
    host_error=p['host'] / host - 1 if host else p['host'],
    outside=outside_model(result),
  )


def returned_through_host(result: dict[str, Any]) -> int:
  """Host bytes a compile held the new 16-bit weights in, then copied.

  Compiles of the `stream` step made before its buckets wrote their new
  weights over their gradients (no start says so) returned 16-bit
  weights cast on the host through host buffers of their own: its host
  temporaries (XLA:GPU of jaxlib 0.12.0.1; that of 0.12.1 kept them in
  device memory). The planner no longer counts those, so they are left
  out of such a compile's host bytes.
  """
  starts = result.get('optimizer_calls') or []
  if any(c.get('weights_alias_grads') for c in starts):
    return 0
  if result['fields'].get('param_dtype', 'float32') == 'float32':
    return 0
  return result['memory'].get('host_temp_size_in_bytes', 0)


# Arguments + outputs - aliased + temporaries: what the step occupies.
_SUM = (('argument', 1), ('output', 1), ('alias', -1), ('temp', 1))


def table_row(c: dict[str, Any]) -> str:
  """A row of `--table`: compiled and planned GB, errors, and why not."""
  host = f'{c["host_error"]:+.1%}' if c['host'] else '-'
  return (
    f'| {c["label"]} | {c["jax"]} | {c["device"] / 1e9:.3f} | '
    f'{c["planner_device"] / 1e9:.3f} | {c["device_error"]:+.1%} | '
    f'{c["host"] / 1e9:.3f} | {c["planner_host"] / 1e9:.3f} | {host} | '
    f'{c["outside"] or ""} |'
  )


TABLE_HEAD = (
  '| case | jax | device GB | planner | error | host GB | planner | error '
  '| outside the model |\n|---|---|---|---|---|---|---|---|---|'
)


def main(argv: list[str]) -> int:
  table = argv[:1] == ['--table']
  paths = argv[1:] if table else argv
  for path in paths:
    if len(paths) > 1:
      print(f'\n## {path}\n')
    if table:
      print(TABLE_HEAD)
    for r in compiled_cases(path):
      c = compare(r)
      if table:
        print(table_row(c))
        continue
      why = f' [outside the model: {c["outside"]}]' if c['outside'] else ''
      print(
        f'{c["label"]}: compiled {c["device"] / 1e9:.2f} GB device, '
        f'{c["host"] / 1e9:.2f} host; planner '
        f'{c["planner_device"] / 1e9:.2f}, {c["planner_host"] / 1e9:.2f} '
        f'({c["device_error"]:+.0%} device){why}'
      )
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
