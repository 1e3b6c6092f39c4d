"""A tiny MaxText pre-train config for the CPU: MaxText's base.yml, shrunk.

Two decoder layers of width 64, synthetic data, fp32 weights and compute,
no checkpoints unless asked: a run of 20 steps takes seconds of training
after about ten of compiling on a 2-core machine.
"""

from __future__ import annotations

import pathlib


def base_config() -> str:
  """MaxText's own base.yml, where MaxText is installed."""
  import maxtext

  return str(pathlib.Path(maxtext.__file__).parent / 'configs' / 'base.yml')


def overrides(output_dir: str, run_name: str = 'tiny', **more) -> list[str]:
  """The `key=value` arguments of the tiny run (`more` added or replacing)."""
  values = {
    'run_name': run_name,
    'base_output_directory': output_dir,
    'dataset_type': 'synthetic',
    'hardware': 'cpu',
    'attention': 'dot_product',
    'base_num_decoder_layers': 2,
    'base_emb_dim': 64,
    'base_num_query_heads': 4,
    'base_num_kv_heads': 4,
    'head_dim': 16,
    'base_mlp_dim': 128,
    'vocab_size': 256,
    'max_target_length': 32,
    'per_device_batch_size': 2,
    'steps': 20,
    'skip_jax_distributed_system': 'true',
    'enable_checkpointing': 'false',
    'async_checkpointing': 'false',
    'weight_dtype': 'float32',
    'dtype': 'float32',
    'log_period': 5,
    'enable_tensorboard': 'false',
    **more,
  }
  return [f'{k}={v}' for k, v in values.items()]
