"""Configuration for the byte-level decoder-only LM trainer.

One flat dataclass holds every knob, in groups (model, data, optimizer,
offload, checkpoint, logging) that ``--help`` lists the flags under and
``config.json`` nests them in (`grouped`); code reads them flat
(``cfg.d_model``), and a flag is named after its field alone. The
defaults are the ``small`` preset, which trains in a few minutes on two CPU
cores. Other presets override a subset of the fields; every field can also be
overridden from the command line (``--batch-size 8``, ``--no-tie-embeddings``).

`validate` checks a config for mistakes that can be found without touching a
device; it, the parser and `get_config` raise `ConfigError` with a one-line
message.
"""

import argparse
import dataclasses
import functools
import math
import os
import pathlib
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
  # Vocabulary size; 256 for raw bytes, and at least the data's largest
  # token id + 1.
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
  # Compute dtype of activations ("float32", "bfloat16" or "float16").
  dtype: str = 'float32'
  # Storage dtype of the parameters.
  param_dtype: str = 'float32'
  # Stack the blocks' weights and run them with one `jax.lax.scan`.
  scan_layers: bool = False

  # --- Data ---
  # Text file or folder to train on; None uses the stdlib's own sources.
  data: str | None = None
  # Read at most this many bytes of corpus.
  data_max_bytes: int = 4_000_000
  # Share of the corpus, at its end, held out for evaluation.
  eval_fraction: float = 0.05
  # Tokens per training sequence (context length).
  seq_len: int = 128
  # Sequences per micro-batch.
  batch_size: int = 16
  # Micro-batches whose mean gradient makes one step (optax.MultiSteps).
  grad_accum: int = 1
  # Seed for parameter init and data order.
  seed: int = 0

  # --- Optimizer ---
  # "superoffload" (host Adam), "optax" (optax.adamw) or "device".
  optimizer: str = 'superoffload'
  # Total number of training steps, counting those before a resume.
  steps: int = 600
  # Peak learning rate of the schedule.
  learning_rate: float = 3e-3
  # Learning-rate schedule after the warmup: "cosine", "linear", "constant"
  # or "wsd" (warmup-stable-decay: constant, then linear over the last
  # `decay_fraction` of the steps).
  schedule: str = 'cosine'
  # Steps of linear warmup from 0 to `learning_rate`.
  warmup_steps: int = 60
  # Final learning rate as a fraction of the peak.
  min_lr_ratio: float = 0.1
  # wsd: share of the steps spent decaying at the end.
  decay_fraction: float = 0.2
  # Adam first-moment decay, in [0, 1).
  b1: float = 0.9
  # Adam second-moment decay, in [0, 1).
  b2: float = 0.95
  # Adam epsilon (>= 0).
  eps: float = 1e-8
  # Decoupled weight decay (skipped for biases, norms and embeddings).
  weight_decay: float = 0.1
  # Global-norm gradient clipping (> 0); superoffload does it by
  # speculation-then-validation, optax by clip_by_global_norm.
  clip_norm: float | None = None
  # On a non-finite loss or state: "stop" (keeping the last good
  # checkpoint) or "continue".
  on_nonfinite: str = 'stop'

  # --- Offload ---
  # superoffload: where its step runs: "auto", "ffi", "xla_host", "device".
  executor: str = 'auto'
  # Drop steps whose gradients hold NaN or Inf (superoffload: by STV;
  # optax: apply_if_finite).
  skip_nonfinite: bool = False
  # superoffload: casting side, "host", "device" or "auto".
  cast: str = 'host'
  # superoffload: fraction in [0, 1] of buckets kept and updated on the
  # device.
  device_buckets: float = 0.0
  # superoffload: bucket size in MiB (None: the library's 256). Small
  # buckets start their host step while the backward pass still runs.
  bucket_mib: float | None = 4.0
  # superoffload: how Adam's moments are stored: "fp32", "bf16" (mu and
  # nu) or "8bit" (blockwise, one fp32 scale per 256).
  moments: str = 'fp32'
  # Block weights: "stationary" (device) or "flow" (host, streamed; scanned).
  weights_policy: str = 'stationary'
  # Data-parallel size: mesh axis 'data', which shards the batch.
  mesh_data: int = 1
  # Ulysses sequence-parallel size: mesh axis 'seq', which shards sequences.
  mesh_seq: int = 1
  # ZeRO: shard the optimizer's host state over the 'data' axis.
  zero: bool = False

  # --- Distributed ---
  # jax.distributed: "off" (one process unless --coordinator is given) or
  # "auto" (the cluster auto-detection of jax.distributed.initialize:
  # SLURM, Open MPI, Cloud TPU; explicit flags below override it).
  distributed: str = 'off'
  # Coordinator "host:port" (process 0's host); starts jax.distributed.
  coordinator: str | None = None
  # Number of processes of the run (with --coordinator).
  num_processes: int | None = None
  # This process's id in [0, num_processes) (with --coordinator).
  process_id: int | None = None
  # Seconds without heartbeats after which XLA declares a process dead and
  # aborts the others (a killed process is caught at once by the watchdog).
  heartbeat_timeout_s: int = 100
  # Seconds a finishing process waits for the others at shutdown.
  shutdown_timeout_s: int = 300
  # Seconds to wait for every process to join at start.
  init_timeout_s: int = 300

  # --- Checkpoint ---
  # Checkpoint folder (also for SIGINT/SIGTERM); None: <out_dir>/checkpoints.
  checkpoint_dir: str | None = None
  # Checkpoint every N steps and at the end; 0: at the end iff a dir is set.
  checkpoint_every: int = 0
  # Number of latest checkpoints kept on disk.
  checkpoint_keep: int = 3
  # Continue from the newest intact checkpoint (data position and run dir
  # too).
  resume: bool = False

  # --- Logging ---
  # Run folder; None: runs/<timestamp>, or on --resume the checkpoint's.
  out_dir: str | None = None
  # Evaluate on the held-out split every N steps and at the end; 0: never.
  eval_every: int = 100
  # Batches (of `batch_size` sequences) per evaluation.
  eval_batches: int = 4
  # Number of last steps averaged into the reported final loss.
  final_loss_window: int = 10
  # Write TensorBoard event files (tensorboardX) beside metrics.jsonl.
  tensorboard: bool = True
  # Also log the global norm of each step's update. Off by default: the
  # norm keeps every update alive until it is reduced, which undoes the
  # in-place weight update (19M model: 14 MB of temporaries become 73 MB,
  # and ~19,000 page faults a step). The gradient and parameter norms cost
  # nothing of the kind and are always logged.
  update_norm: bool = False
  # Trace steps a:b (a included, b not) with jax.profiler into
  # <out_dir>/profile; None: no trace.
  profile_steps: str | None = None
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
MOMENTS = ('fp32', 'bf16', '8bit')
SCHEDULES = ('cosine', 'linear', 'constant', 'wsd')
ON_NONFINITE = ('stop', 'continue')
DTYPES = ('float32', 'bfloat16', 'float16')
DISTRIBUTED = ('off', 'auto')
CHOICES: dict[str, tuple[str, ...]] = {
  'optimizer': OPTIMIZERS,
  'schedule': SCHEDULES,
  'on_nonfinite': ON_NONFINITE,
  'dtype': DTYPES,
  'param_dtype': DTYPES,
  'executor': EXECUTORS,
  'cast': CASTS,
  'moments': MOMENTS,
  'pos_encoding': POS_ENCODINGS,
  'weights_policy': WEIGHTS_POLICIES,
  'distributed': DISTRIBUTED,
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
    # Tests turn evaluation on where they check it: it compiles a second
    # program.
    eval_every=0,
    eval_batches=2,
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


@functools.cache
def _config_source_lines() -> tuple[str, ...]:
  """The lines of `Config`'s definition, read from this file.

  Not `inspect.getsource`, which parses the module with `ast`: on CPython
  3.11 a garbage collection during that parse that finalises an abandoned
  coroutine (Orbax leaves some after a failed read of a damaged
  checkpoint) can fail it with "AST constructor recursion depth mismatch".
  """
  lines = pathlib.Path(__file__).read_text().splitlines()
  start = lines.index('class Config:')
  end = next(
    i
    for i in range(start + 1, len(lines))
    if lines[i] and not lines[i].startswith(' ')
  )
  return tuple(lines[start:end])


def _field_comments() -> dict[str, str]:
  """Maps each field name to the comment lines just above it in `Config`."""
  comments: dict[str, str] = {}
  lines: list[str] = []
  for line in _config_source_lines():
    line = line.strip()
    if line.startswith('# ---'):
      lines = []
    elif line.startswith('#'):
      lines.append(line.lstrip('#').strip())
    elif m := re.match(r'(\w+):', line):
      comments[m.group(1)] = ' '.join(lines)
      lines = []
  return comments


def field_groups() -> dict[str, list[str]]:
  """Maps each ``# --- Group ---`` header of `Config` to its fields, in order.

  The groups (model, data, optimizer, offload, checkpoint, logging) are what
  ``--help`` shows the flags under; `preset` belongs to none.
  """
  groups: dict[str, list[str]] = {}
  current: list[str] | None = None
  for line in _config_source_lines():
    line = line.strip()
    if m := re.match(r'# --- (\w+) ---', line):
      current = groups.setdefault(m.group(1).lower(), [])
    elif (m := re.match(r'(\w+):', line)) and current is not None:
      current.append(m.group(1))
  return groups


def grouped(cfg: Config) -> dict[str, Any]:
  """`cfg` as ``{"preset": ..., "model": {...}, "data": {...}, ...}``.

  The form the trainer writes to ``config.json``, grouped as `field_groups`
  (and ``--help``) group the fields.
  """
  values = dataclasses.asdict(cfg)
  out: dict[str, Any] = {'preset': values['preset']}
  for group, names in field_groups().items():
    out[group] = {name: values[name] for name in names}
  return out


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

  Flags are listed by group (model, data, optimizer, ...), each with the
  comment above its field as help. Bad flags raise `ConfigError` instead of
  exiting.
  """
  parser = _Parser(
    prog='python -m experiments.train',
    description='Train a byte-level decoder-only LM.',
  )
  hints = typing.get_type_hints(Config)
  comments = _field_comments()
  defaults = Config()
  parser.add_argument(
    '--preset',
    default='small',
    choices=list(PRESETS),
    help=f'{comments["preset"]} (default: %(default)s)',
  )
  for group_name, names in field_groups().items():
    group = parser.add_argument_group(group_name)
    for name in names:
      flag = '--' + name.replace('_', '-')
      comment = comments.get(name, '').replace('%', '%%')
      # Flags default to None ("keep the preset's value").
      help_ = f'{comment} (small: {getattr(defaults, name)})'
      tp = _base_type(hints[name])
      if tp is bool:
        action = argparse.BooleanOptionalAction
        group.add_argument(flag, action=action, default=None, help=help_)
      else:
        group.add_argument(
          flag,
          type=_none_or(tp),
          default=None,
          choices=CHOICES.get(name),
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

  Besides values the trainer or the library would reject, it refuses values
  that cannot train: a learning rate that is not a finite positive number,
  betas outside [0, 1), a negative epsilon, a non-finite weight decay.

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
  _validate_counts(cfg)
  _validate_optimizer(cfg)
  _validate_model_and_mesh(cfg)
  _validate_run(cfg)
  _validate_distributed(cfg)


def _validate_distributed(cfg: Config) -> None:
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
  if cfg.coordinator is not None and ':' not in cfg.coordinator:
    raise ConfigError(
      f'coordinator must be "host:port", got {cfg.coordinator!r}'
    )


def _validate_counts(cfg: Config) -> None:
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


def _validate_optimizer(cfg: Config) -> None:
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
    raise ConfigError('--zero needs --optimizer superoffload or device')
  if cfg.moments != 'fp32' and cfg.optimizer != 'superoffload':
    raise ConfigError('--moments bf16/8bit needs --optimizer superoffload')


def _validate_model_and_mesh(cfg: Config) -> None:
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


def _validate_run(cfg: Config) -> None:
  """Paths, evaluation and profiling."""
  if not 0.0 <= cfg.eval_fraction < 1.0:
    raise ConfigError(
      f'eval_fraction must be in [0, 1), got {cfg.eval_fraction}'
    )
  if cfg.eval_every and cfg.eval_fraction == 0:
    raise ConfigError('--eval-every needs --eval-fraction > 0')
  if cfg.profile_steps is not None:
    parse_profile_steps(cfg.profile_steps)
  if cfg.data is not None and not os.path.exists(os.path.expanduser(cfg.data)):
    raise ConfigError(f'--data: no such file or folder: {cfg.data}')
  if cfg.resume and cfg.checkpoint_dir is None and cfg.out_dir is None:
    raise ConfigError('--resume needs --checkpoint-dir (or --out-dir)')
  if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
    raise ConfigError(f'peak_tflops must be positive, got {cfg.peak_tflops}')
