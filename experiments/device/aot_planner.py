"""The planner's prediction for a step the harness compiles.

  python -m experiments.device.aot_planner AOT_JSON

prints it beside each compiled case of `experiments.device.aot`'s JSON.

`predict` asks `jax_superoffload.plan` about the trainer's step of a case:
the same model (`planner_spec`), the trainer's policies, and the GPU's
budgets from `gpu_targets` with no reserve (`planner_profile`), so that
its device bytes, host bytes and fit stand beside the compiled ones.
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

  bf16 or fp32 activations as `cfg.dtype`; checkpointed when the layers
  are scanned (`weight_flow_scan` rematerializes each block, keeping its
  input); attention as `jax.nn.dot_product_attention` computes it by
  default, with its scores materialized (not flash attention).
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
    activation_checkpointing=cfg.scan_layers,
    flash_attention=False,
  )


def predict(cfg: config_lib.Config, params: int, gpu: str) -> dict[str, Any]:
  """The planner's device bytes, host bytes and fit for the trainer's step.

  optax's step is the planner's device-resident Adam reference; the
  superoffload step is the plan with the trainer's policies: its weights
  policy, cast side, bucket size, device buckets, moments, and STV armed
  when it clips or skips non-finite steps.
  """
  spec, hw = planner_spec(cfg, params), planner_profile(gpu)
  if cfg.device_buckets:
    raise ValueError(
      f'device_buckets={cfg.device_buckets}: the comparison covers the '
      "trainer's default, no device buckets"
    )
  if cfg.optimizer == 'optax':
    p = superoffload.plan(spec, hw, moments='fp32').device_adam
  else:
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
  return dict(device=p.device_bytes, host=p.host_bytes, fits=p.fits)


def trainer_config(fields: dict[str, Any]) -> config_lib.Config:
  """The trainer's config of a case given as its JSON fields."""
  case = aot_steps.Case(
    **{**fields, 'overrides': tuple(map(tuple, fields['overrides']))}
  )
  return aot_steps.trainer_config(case)


def main(argv: list[str]) -> int:
  rows = json.loads(pathlib.Path(argv[0]).read_text())
  if isinstance(rows, dict):  # A results file: the cases and their context.
    rows = rows['cases']
  for r in rows:
    if not r.get('compiles'):
      continue
    cfg = trainer_config(r['fields'])
    p = predict(cfg, r['num_params'], r['fields']['gpu'])
    print(
      f'{r["case"]}: compiled {r["device_GB"]:.2f} GB device, '
      f'{r["host_GB"]:.2f} host; planner {p["device"] / 1e9:.2f}, '
      f'{p["host"] / 1e9:.2f} ({p["device"] / 1e9 / r["device_GB"] - 1:+.0%}'
      ' device)'
    )
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
