"""Checks of a config that need no device: `validate`.

`validate` refuses what the trainer or the library would reject late, and
values that cannot train (a learning rate that is not a finite positive
number, betas outside [0, 1), ...), each with a one-line `ConfigError`.
"""

import math
import os
import re

from experiments.trainer import config as config_lib
from experiments.trainer.config import CHOICES
from experiments.trainer.config import ConfigError


def validate(cfg: config_lib.Config) -> None:
  """Checks a config for mistakes that need no device to find.

  Besides values the trainer or the library would reject, it refuses values
  that cannot train: a learning rate that is not a finite positive number,
  betas outside [0, 1), a negative epsilon, a non-finite weight decay.

  Args:
    cfg: The configuration.

  Raises:
    ConfigError: On the first problem found, with a one-line message.
  """
  for field, choices in CHOICES.items():
    if getattr(cfg, field) not in choices:
      raise ConfigError(
        f'{field}={getattr(cfg, field)!r} is not one of {list(choices)}'
      )
  _validate_counts(cfg)
  _validate_optimizer(cfg)
  _validate_model_and_mesh(cfg)
  _validate_run(cfg)
  _validate_distributed(cfg)


def _validate_distributed(cfg: config_lib.Config) -> None:
  """The launch flags: all three explicit ones together, or auto."""
  explicit = {
    'coordinator': cfg.coordinator,
    'num_processes': cfg.num_processes,
    'process_id': cfg.process_id,
  }
  given = [k for k, v in explicit.items() if v is not None]
  if cfg.distributed == 'off' and given and len(given) < 3:
    missing = ', '.join(
      '--' + k.replace('_', '-') for k in explicit if k not in given
    )
    raise ConfigError(
      f'--{given[0].replace("_", "-")} needs {missing} too (or '
      '--distributed auto)'
    )
  if cfg.num_processes is not None and cfg.num_processes < 1:
    raise ConfigError(
      f'num_processes must be at least 1, got {cfg.num_processes}'
    )
  if cfg.process_id is not None and not (
    0 <= cfg.process_id < (cfg.num_processes or cfg.process_id + 1)
  ):
    raise ConfigError(
      f'process_id ({cfg.process_id}) must be in [0, num_processes '
      f'({cfg.num_processes}))'
    )
  for name in ('coordinator', 'coordinator_bind'):
    value = getattr(cfg, name)
    if value is not None and ':' not in value:
      raise ConfigError(f'{name} must be "host:port", got {value!r}')


def _validate_counts(cfg: config_lib.Config) -> None:
  """Integer sizes and periods."""
  positive = (
    'vocab_size',
    'd_model',
    'num_layers',
    'num_heads',
    'mlp_dim',
    'seq_len',
    'batch_size',
    'grad_accum',
    'steps',
    'mesh_data',
    'mesh_seq',
    'checkpoint_keep',
    'data_max_bytes',
    'eval_batches',
    'final_loss_window',
    'heartbeat_timeout_s',
    'shutdown_timeout_s',
    'init_timeout_s',
  )
  for field in positive:
    if getattr(cfg, field) < 1:
      raise ConfigError(
        f'{field} must be at least 1, got {getattr(cfg, field)}'
      )
  for field in ('checkpoint_every', 'warmup_steps', 'eval_every'):
    if getattr(cfg, field) < 0:
      raise ConfigError(f'{field} must be >= 0, got {getattr(cfg, field)}')


def _finite(field: str, value: float) -> None:
  if not math.isfinite(value):
    raise ConfigError(f'{field} must be finite, got {value}')


def _validate_optimizer(cfg: config_lib.Config) -> None:
  """Hyperparameters that would fail in the optimizer or cannot train."""
  _finite('learning_rate', cfg.learning_rate)
  if cfg.learning_rate <= 0:
    raise ConfigError(
      f'learning_rate must be positive, got {cfg.learning_rate}'
    )
  for field in ('b1', 'b2'):
    value = getattr(cfg, field)
    if not 0.0 <= value < 1.0:  # Also false for NaN.
      raise ConfigError(f'{field} must be in [0, 1), got {value}')
  for field in ('eps', 'weight_decay'):
    _finite(field, getattr(cfg, field))
    if getattr(cfg, field) < 0:
      raise ConfigError(f'{field} must be >= 0, got {getattr(cfg, field)}')
  for field in ('min_lr_ratio', 'decay_fraction', 'device_buckets'):
    value = getattr(cfg, field)
    if not 0.0 <= value <= 1.0:
      raise ConfigError(f'{field} must be in [0, 1], got {value}')
  if cfg.clip_norm is not None and not cfg.clip_norm > 0:
    raise ConfigError(f'clip_norm must be positive, got {cfg.clip_norm}')
  if cfg.clip_norm is not None:
    _finite('clip_norm', cfg.clip_norm)
  if cfg.bucket_mib is not None and not cfg.bucket_mib * 2**20 >= 4:
    raise ConfigError(f'bucket_mib must be positive, got {cfg.bucket_mib}')
  if cfg.bucket_mib is not None:
    _finite('bucket_mib', cfg.bucket_mib)
  if cfg.zero and cfg.optimizer == 'optax':
    raise ConfigError('zero needs --config.optimizer=superoffload or device')
  if cfg.moments != 'fp32' and cfg.optimizer != 'superoffload':
    raise ConfigError('moments bf16/8bit need --config.optimizer=superoffload')


def _validate_model_and_mesh(cfg: config_lib.Config) -> None:
  """Shapes that must divide each other."""
  if cfg.d_model % cfg.num_heads:
    raise ConfigError(
      f'num_heads ({cfg.num_heads}) must divide d_model ({cfg.d_model})'
    )
  if cfg.pos_encoding == 'rope' and (cfg.d_model // cfg.num_heads) % 2:
    raise ConfigError(
      f'rope needs an even head width, got d_model/num_heads = '
      f'{cfg.d_model // cfg.num_heads}'
    )
  if cfg.weights_policy == 'flow' and not cfg.scan_layers:
    raise ConfigError('weights_policy=flow needs --config.scan_layers')
  if cfg.batch_size % cfg.mesh_data:
    raise ConfigError(
      f'batch_size ({cfg.batch_size}) must be divisible by the data-parallel '
      f'size mesh_data ({cfg.mesh_data})'
    )
  if cfg.seq_len % cfg.mesh_seq:
    raise ConfigError(
      f'seq_len ({cfg.seq_len}) must be divisible by the sequence-parallel '
      f'size mesh_seq ({cfg.mesh_seq})'
    )
  if cfg.num_heads % cfg.mesh_seq:
    raise ConfigError(
      f'num_heads ({cfg.num_heads}) must be divisible by the '
      f'sequence-parallel size mesh_seq ({cfg.mesh_seq})'
    )


def parse_profile_steps(text: str) -> tuple[int, int]:
  """Parses ``"a:b"`` into ``(a, b)`` with ``0 <= a < b``.

  Raises:
    ConfigError: If `text` is not of that form.
  """
  m = re.fullmatch(r'\s*(\d+)\s*:\s*(\d+)\s*', text)
  if not m or int(m.group(1)) >= int(m.group(2)):
    raise ConfigError(
      f'profile_steps must be "a:b" with 0 <= a < b, got {text!r}'
    )
  return int(m.group(1)), int(m.group(2))


def _validate_run(cfg: config_lib.Config) -> None:
  """Paths, evaluation and profiling."""
  if not 0.0 <= cfg.eval_fraction < 1.0:
    raise ConfigError(
      f'eval_fraction must be in [0, 1), got {cfg.eval_fraction}'
    )
  if cfg.eval_every and cfg.eval_fraction == 0:
    raise ConfigError('eval_every needs --config.eval_fraction > 0')
  if cfg.profile_steps is not None:
    parse_profile_steps(cfg.profile_steps)
  if cfg.data is not None and not os.path.exists(os.path.expanduser(cfg.data)):
    raise ConfigError(f'data: no such file or folder: {cfg.data}')
  if cfg.resume and cfg.checkpoint_dir is None and cfg.out_dir is None:
    raise ConfigError(
      'resume needs --config.checkpoint_dir (or --config.out_dir)'
    )
  if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
    raise ConfigError(f'peak_tflops must be positive, got {cfg.peak_tflops}')
