"""Configuration for the byte-level decoder-only LM trainer.

One flat dataclass holds every knob (model, data, optimizer, logging). The
defaults are the ``small`` preset, which trains in a few minutes on two CPU
cores. Other presets override a subset of the fields; every field can also be
overridden from the command line (``--batch-size 8``, ``--no-tie-embeddings``).

`validate` checks a config for mistakes that can be found without touching a
device; it, the parser and `get_config` raise `ConfigError` with a one-line
message.
"""

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
  """A bad configuration; its message is one line, fit for the terminal."""


@dataclasses.dataclass(frozen=True)
class Config:
  """All hyperparameters of a training run."""

  # Named preset the other fields started from (see `PRESETS`).
  preset: str = 'small'

  # --- Model ---
  # Vocabulary size; 256 for raw bytes.
  vocab_size: int = 256
  # Width of the residual stream.
  d_model: int = 128
  # Number of transformer blocks.
  num_layers: int = 2
  # Number of attention heads; must divide `d_model`.
  num_heads: int = 4
  # Hidden width of the MLP in each block.
  mlp_dim: int = 512
  # Position encoding: "rope" (rotary) or "learned" (absolute table).
  pos_encoding: str = 'rope'
  # Share the token embedding with the output head.
  tie_embeddings: bool = True
  # Use biases in the linear layers.
  use_bias: bool = True
  # Stddev of the normal initializer for kernels and embeddings.
  init_std: float = 0.02
  # Compute dtype of activations ("float32" or "bfloat16").
  dtype: str = 'float32'
  # Storage dtype of the parameters.
  param_dtype: str = 'float32'
  # Stack the blocks' weights and run them with one `jax.lax.scan`.
  scan_layers: bool = False
  # Block weights: "stationary" (device) or "flow" (host, streamed; scanned).
  weights_policy: str = 'stationary'

  # --- Data ---
  # Text file or folder to train on; None uses the stdlib's own sources.
  data: str | None = None
  # Read at most this many bytes of corpus.
  data_max_bytes: int = 4_000_000
  # Tokens per training sequence (context length).
  seq_len: int = 128
  # Sequences per batch.
  batch_size: int = 16

  # --- Optimizer ---
  # "superoffload" (host Adam), "optax" (optax.adamw) or "device".
  optimizer: str = 'superoffload'
  # Total number of training steps, counting those before a resume.
  steps: int = 600
  # Peak learning rate of the warmup + cosine schedule.
  learning_rate: float = 3e-3
  # Steps of linear warmup from 0 to `learning_rate`.
  warmup_steps: int = 60
  # Final learning rate as a fraction of the peak.
  min_lr_ratio: float = 0.1
  # Adam first-moment decay.
  b1: float = 0.9
  # Adam second-moment decay.
  b2: float = 0.95
  # Adam epsilon.
  eps: float = 1e-8
  # Decoupled weight decay (skipped for biases, norms and embeddings).
  weight_decay: float = 0.1
  # superoffload: where its step runs: "auto", "ffi", "xla_host", "device".
  executor: str = 'auto'
  # superoffload: global-norm clipping by speculation-then-validation.
  clip_norm: float | None = None
  # superoffload: drop steps whose gradients hold NaN or Inf.
  skip_nonfinite: bool = False
  # superoffload: casting side, "host", "device" or "auto".
  cast: str = 'host'
  # superoffload: fraction of buckets kept and updated on the device.
  device_buckets: float = 0.0
  # superoffload: bucket size in MiB (None: the library's 256). Small
  # buckets start their host step while the backward pass still runs.
  bucket_mib: float | None = 4.0

  # --- Mesh ---
  # Data-parallel size: mesh axis 'data', which shards the batch.
  mesh_data: int = 1
  # Ulysses sequence-parallel size: mesh axis 'seq', which shards sequences.
  mesh_seq: int = 1
  # ZeRO: shard the optimizer's host state over the 'data' axis.
  zero: bool = False

  # --- Checkpoints ---
  # Checkpoint folder (also for SIGINT/SIGTERM); None: <out_dir>/checkpoints.
  checkpoint_dir: str | None = None
  # Checkpoint every N steps and at the end; 0: at the end iff a dir is set.
  checkpoint_every: int = 0
  # Number of latest checkpoints kept on disk.
  checkpoint_keep: int = 3
  # Continue from the latest checkpoint (data position and run dir too).
  resume: bool = False

  # --- Run ---
  # Seed for parameter init and data order.
  seed: int = 0
  # Run folder; None: runs/<timestamp>, or on --resume the checkpoint's.
  out_dir: str | None = None
  # Number of last steps averaged into the reported final loss.
  final_loss_window: int = 10
  # Show a tqdm progress bar.
  progress: bool = True
  # Peak TFLOP/s per device for MFU; None: known-chip table or CPU matmul.
  peak_tflops: float | None = None


# Allowed values of the string fields that have a fixed set of them.
OPTIMIZERS = ('superoffload', 'optax', 'device')
POS_ENCODINGS = ('rope', 'learned')
WEIGHTS_POLICIES = ('stationary', 'flow')
EXECUTORS = ('auto', 'ffi', 'xla_host', 'device')
CASTS = ('host', 'device', 'auto')
CHOICES: dict[str, tuple[str, ...]] = {
  'optimizer': OPTIMIZERS,
  'executor': EXECUTORS,
  'cast': CASTS,
  'pos_encoding': POS_ENCODINGS,
  'weights_policy': WEIGHTS_POLICIES,
}

# Overrides of the `Config` defaults for each named preset. Parameter counts
# (byte vocab, tied embeddings) are roughly 12 * num_layers * d_model**2.
PRESETS: dict[str, dict[str, Any]] = {
  # ~17k params: a train step takes milliseconds; for tests.
  'tiny': dict(
    d_model=32,
    num_layers=1,
    num_heads=2,
    mlp_dim=64,
    seq_len=32,
    batch_size=4,
    steps=20,
    warmup_steps=2,
    learning_rate=1e-2,
    data_max_bytes=200_000,
    final_loss_window=3,
  ),
  # ~0.4M params: the CPU demo default (the dataclass defaults).
  'small': dict(),
  # ~127M params.
  '125m': dict(
    d_model=768,
    num_layers=18,
    num_heads=12,
    mlp_dim=3072,
    seq_len=1024,
    batch_size=32,
    steps=20_000,
    warmup_steps=1000,
    learning_rate=6e-4,
    data_max_bytes=1_000_000_000,
    checkpoint_every=1000,
  ),
  # ~353M params.
  '350m': dict(
    d_model=1024,
    num_layers=28,
    num_heads=16,
    mlp_dim=4096,
    seq_len=1024,
    batch_size=32,
    steps=40_000,
    warmup_steps=2000,
    learning_rate=3e-4,
    data_max_bytes=1_000_000_000,
    checkpoint_every=1000,
  ),
  # ~1.0B params.
  '1b': dict(
    d_model=2048,
    num_layers=20,
    num_heads=16,
    mlp_dim=8192,
    seq_len=2048,
    batch_size=16,
    steps=50_000,
    warmup_steps=2000,
    learning_rate=2e-4,
    data_max_bytes=4_000_000_000,
    checkpoint_every=500,
  ),
}


def get_config(preset: str = 'small', **overrides: Any) -> Config:
  """Returns the config of a named preset with optional field overrides.

  Args:
    preset: A key of `PRESETS`.
    **overrides: Field values that replace the preset's.

  Returns:
    The resulting `Config`.

  Raises:
    ConfigError: If `preset` is unknown.
  """
  if preset not in PRESETS:
    raise ConfigError(f'unknown preset {preset!r}; one of {list(PRESETS)}')
  return dataclasses.replace(
    Config(), preset=preset, **{**PRESETS[preset], **overrides}
  )


def _field_comments() -> dict[str, str]:
  """Maps each field name to the comment line just above it in `Config`."""
  comments: dict[str, str] = {}
  last = ''
  for line in inspect.getsource(Config).splitlines():
    line = line.strip()
    if line.startswith('#'):
      last = line.lstrip('# ').strip()
    elif m := re.match(r'(\w+):', line):
      comments[m.group(1)] = last
      last = ''
  return comments


def _base_type(tp: Any) -> Any:
  """Strips `| None` from an annotation."""
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0]
  return tp


def _none_or(tp: type) -> Any:
  """Returns an argparse type that also maps "none" to None."""

  def parse(s: str) -> Any:
    return None if s.lower() == 'none' else tp(s)

  parse.__name__ = tp.__name__
  return parse


class _Parser(argparse.ArgumentParser):
  """An `ArgumentParser` whose errors raise `ConfigError` (one line)."""

  def error(self, message: str) -> typing.NoReturn:
    """Raises instead of printing the usage and exiting."""
    raise ConfigError(message.replace('\n', ' '))


def build_parser() -> argparse.ArgumentParser:
  """Builds a CLI parser with one ``--flag`` per `Config` field.

  Bad flags raise `ConfigError` instead of exiting.
  """
  parser = _Parser(
    prog='python -m experiments.train',
    description='Train a byte-level decoder-only LM.',
  )
  hints = typing.get_type_hints(Config)
  comments = _field_comments()
  defaults = Config()
  for field in dataclasses.fields(Config):
    flag = '--' + field.name.replace('_', '-')
    comment = comments.get(field.name, '').replace('%', '%%')
    if field.name == 'preset':
      help_ = f'{comment} (default: %(default)s)'
      parser.add_argument(
        flag, default='small', choices=list(PRESETS), help=help_
      )
      continue
    # Flags default to None ("keep the preset's value").
    help_ = f'{comment} (small: {getattr(defaults, field.name)})'
    tp = _base_type(hints[field.name])
    if tp is bool:
      action = argparse.BooleanOptionalAction
      parser.add_argument(flag, action=action, default=None, help=help_)
    else:
      parser.add_argument(
        flag,
        type=_none_or(tp),
        default=None,
        choices=CHOICES.get(field.name),
        help=help_,
      )
  return parser


def config_from_args(argv: Sequence[str] | None = None) -> Config:
  """Parses command-line flags into a `Config`.

  Args:
    argv: The flags, without the program name; None reads `sys.argv`.

  Returns:
    The preset named by ``--preset`` with every given flag applied.
  """
  args = vars(build_parser().parse_args(argv))
  preset = args.pop('preset')
  overrides = {k: v for k, v in args.items() if v is not None}
  return get_config(preset, **overrides)


def validate(cfg: Config) -> None:
  """Checks a config for mistakes that need no device to find.

  Args:
    cfg: The configuration.

  Raises:
    ConfigError: On the first problem found, with a one-line message.
  """
  if cfg.preset not in PRESETS:
    raise ConfigError(f'unknown preset {cfg.preset!r}; one of {list(PRESETS)}')
  for field, choices in CHOICES.items():
    if getattr(cfg, field) not in choices:
      raise ConfigError(
        f'{field}={getattr(cfg, field)!r} is not one of {list(choices)}'
      )
  positive = (
    'vocab_size',
    'd_model',
    'num_layers',
    'num_heads',
    'mlp_dim',
    'seq_len',
    'batch_size',
    'steps',
    'mesh_data',
    'mesh_seq',
    'checkpoint_keep',
  )
  for field in positive:
    if getattr(cfg, field) < 1:
      raise ConfigError(
        f'{field} must be at least 1, got {getattr(cfg, field)}'
      )
  if cfg.checkpoint_every < 0:
    raise ConfigError(
      f'checkpoint_every must be >= 0, got {cfg.checkpoint_every}'
    )
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
    raise ConfigError('weights_policy=flow needs --scan-layers')
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
  if cfg.zero and cfg.optimizer == 'optax':
    raise ConfigError('--zero needs --optimizer superoffload or device')
  if cfg.data is not None and not os.path.exists(os.path.expanduser(cfg.data)):
    raise ConfigError(f'--data: no such file or folder: {cfg.data}')
  if cfg.resume and cfg.checkpoint_dir is None and cfg.out_dir is None:
    raise ConfigError('--resume needs --checkpoint-dir (or --out-dir)')
  if cfg.bucket_mib is not None and cfg.bucket_mib * 2**20 < 4:
    raise ConfigError(f'bucket_mib must be positive, got {cfg.bucket_mib}')
  if cfg.peak_tflops is not None and cfg.peak_tflops <= 0:
    raise ConfigError(f'peak_tflops must be positive, got {cfg.peak_tflops}')
