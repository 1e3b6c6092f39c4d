"""Configuration for the byte-level decoder-only LM trainer.

One flat, typed dataclass holds every knob. Each field carries its help text
and its group (model, data, optimizer, offload, distributed, checkpoint,
logging) as field metadata: ``--help`` lists the flags under those groups
with that text, and ``config.json`` nests the values the same way
(`grouped`); code reads them flat (``cfg.d_model``).

Named configs are Python files under ``configs/`` at the repository root,
each with a ``get_config()`` returning a `Config` (``configs/demo.py``,
``configs/1b.py``, ...). A run starts from one of them and overrides fields
with one flag per field, named after the field::

    python -m experiments.trainer --config configs/demo.py --steps 100
    python -m experiments.trainer --preset tiny --no-tie-embeddings

``--config`` takes any such file; ``--preset NAME`` is short for
``--config configs/NAME.py``. Without either, the run uses ``demo``.

`validate` checks a config for mistakes that can be found without touching a
device; it, the parser and `get_config` raise `ConfigError` with a one-line
message.
"""

import argparse
import dataclasses
import functools
import importlib.util
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


# Folder of the named configs: configs/ at the repository root.
CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / 'configs'
# The config a run starts from when none is named.
DEFAULT_PRESET = 'demo'
# Older names of configs, still accepted (sweep files use "small").
PRESET_ALIASES = {'small': 'demo'}
# The `--help` groups of the fields, in the order they are listed.
GROUPS = (
  'model',
  'data',
  'optimizer',
  'offload',
  'distributed',
  'checkpoint',
  'logging',
)


def _field(group: str, default: Any, help_: str) -> Any:
  """A `Config` field with its ``--help`` group and text as metadata."""
  assert group in GROUPS, group
  return dataclasses.field(
    default=default, metadata={'group': group, 'help': help_}
  )


_model = functools.partial(_field, 'model')
_data = functools.partial(_field, 'data')
_optimizer = functools.partial(_field, 'optimizer')
_offload = functools.partial(_field, 'offload')
_distributed = functools.partial(_field, 'distributed')
_checkpoint = functools.partial(_field, 'checkpoint')
_logging = functools.partial(_field, 'logging')


@dataclasses.dataclass(frozen=True)
class Config:
  """All hyperparameters of a training run."""

  # The config file the other fields started from (in no group).
  preset: str = dataclasses.field(
    default=DEFAULT_PRESET,
    metadata={
      'help': 'Config the other fields started from: a name of a file under '
      'configs/ (see --preset) or the path given to --config.'
    },
  )

  # Model.
  vocab_size: int = _model(
    256,
    "Vocabulary size; 256 for raw bytes, and at least the data's "
    'largest token id + 1.',
  )
  d_model: int = _model(128, 'Width of the residual stream.')
  num_layers: int = _model(2, 'Number of transformer blocks.')
  num_heads: int = _model(
    4, 'Number of attention heads; must divide `d_model`.'
  )
  mlp_dim: int = _model(512, 'Hidden width of the MLP in each block.')
  pos_encoding: str = _model(
    'rope', 'Position encoding: "rope" (rotary) or "learned" (absolute table).'
  )
  tie_embeddings: bool = _model(
    True, 'Share the token embedding with the output head.'
  )
  use_bias: bool = _model(True, 'Use biases in the linear layers.')
  init_std: float = _model(
    0.02, 'Stddev of the normal initializer for kernels and embeddings.'
  )
  dtype: str = _model(
    'float32',
    'Compute dtype of activations ("float32", "bfloat16" or "float16").',
  )
  param_dtype: str = _model('float32', 'Storage dtype of the parameters.')
  scan_layers: bool = _model(
    False, "Stack the blocks' weights and run them with one `jax.lax.scan`."
  )

  # Data.
  data: str | None = _data(
    None, "Text file or folder to train on; None uses the stdlib's own sources."
  )
  data_max_bytes: int = _data(
    4_000_000, 'Read at most this many bytes of corpus.'
  )
  eval_fraction: float = _data(
    0.05, 'Share of the corpus, at its end, held out for evaluation.'
  )
  seq_len: int = _data(128, 'Tokens per training sequence (context length).')
  batch_size: int = _data(16, 'Sequences per micro-batch.')
  grad_accum: int = _data(
    1, 'Micro-batches whose mean gradient makes one step (optax.MultiSteps).'
  )
  seed: int = _data(0, 'Seed for parameter init and data order.')

  # Optimizer.
  optimizer: str = _optimizer(
    'superoffload',
    '"superoffload" (host Adam), "optax" (optax.adamw) or "device".',
  )
  steps: int = _optimizer(
    600, 'Total number of training steps, counting those before a resume.'
  )
  learning_rate: float = _optimizer(3e-3, 'Peak learning rate of the schedule.')
  schedule: str = _optimizer(
    'cosine',
    'Learning-rate schedule after the warmup: "cosine", "linear", '
    '"constant" or "wsd" (warmup-stable-decay: constant, then linear '
    'over the last `decay_fraction` of the steps).',
  )
  warmup_steps: int = _optimizer(
    60, 'Steps of linear warmup from 0 to `learning_rate`.'
  )
  min_lr_ratio: float = _optimizer(
    0.1, 'Final learning rate as a fraction of the peak.'
  )
  decay_fraction: float = _optimizer(
    0.2, 'wsd: share of the steps spent decaying at the end.'
  )
  b1: float = _optimizer(0.9, 'Adam first-moment decay, in [0, 1).')
  b2: float = _optimizer(0.95, 'Adam second-moment decay, in [0, 1).')
  eps: float = _optimizer(1e-8, 'Adam epsilon (>= 0).')
  weight_decay: float = _optimizer(
    0.1, 'Decoupled weight decay (skipped for biases, norms and embeddings).'
  )
  clip_norm: float | None = _optimizer(
    None,
    'Global-norm gradient clipping (> 0); superoffload does it by '
    'speculation-then-validation, optax by clip_by_global_norm.',
  )
  on_nonfinite: str = _optimizer(
    'stop',
    'On a non-finite loss or state: "stop" (keeping the last good '
    'checkpoint) or "continue".',
  )

  # Offload.
  executor: str = _offload(
    'auto',
    'superoffload: where its step runs: "auto", "ffi", "xla_host", "device".',
  )
  skip_nonfinite: bool = _offload(
    False,
    'Drop steps whose gradients hold NaN or Inf (superoffload: by STV; '
    'optax: apply_if_finite).',
  )
  cast: str = _offload(
    'host', 'superoffload: casting side, "host", "device" or "auto".'
  )
  device_buckets: float = _offload(
    0.0,
    'superoffload: fraction in [0, 1] of buckets kept and updated on '
    'the device.',
  )
  bucket_mib: float | None = _offload(
    4.0,
    "superoffload: bucket size in MiB (None: the library's 256). Small "
    'buckets start their host step while the backward pass still runs.',
  )
  moments: str = _offload(
    'fp32',
    'superoffload: how Adam\'s moments are stored: "fp32", "bf16" (mu '
    'and nu) or "8bit" (blockwise, one fp32 scale per 256).',
  )
  weights_policy: str = _offload(
    'stationary',
    'Block weights: "stationary" (device) or "flow" (host, streamed; scanned).',
  )
  mesh_data: int = _offload(
    1, "Data-parallel size: mesh axis 'data', which shards the batch."
  )
  mesh_seq: int = _offload(
    1,
    "Ulysses sequence-parallel size: mesh axis 'seq', which shards sequences.",
  )
  zero: bool = _offload(
    False, "ZeRO: shard the optimizer's host state over the 'data' axis."
  )

  # Distributed.
  distributed: str = _distributed(
    'off',
    'jax.distributed: "off" (one process unless --coordinator is given)'
    ' or "auto" (the cluster auto-detection of '
    'jax.distributed.initialize: SLURM, Open MPI, Cloud TPU; explicit '
    'flags below override it).',
  )
  coordinator: str | None = _distributed(
    None, 'Coordinator "host:port" (process 0\'s host); starts jax.distributed.'
  )
  num_processes: int | None = _distributed(
    None, 'Number of processes of the run (with --coordinator).'
  )
  process_id: int | None = _distributed(
    None, "This process's id in [0, num_processes) (with --coordinator)."
  )
  heartbeat_timeout_s: int = _distributed(
    100,
    'Seconds without heartbeats after which XLA declares a process dead'
    ' and aborts the others (a killed process is caught at once by the '
    'watchdog).',
  )
  shutdown_timeout_s: int = _distributed(
    300, 'Seconds a finishing process waits for the others at shutdown.'
  )
  init_timeout_s: int = _distributed(
    300, 'Seconds to wait for every process to join at start.'
  )

  # Checkpoint.
  checkpoint_dir: str | None = _checkpoint(
    None,
    'Checkpoint folder (also for SIGINT/SIGTERM); None: <out_dir>/checkpoints.',
  )
  checkpoint_every: int = _checkpoint(
    0,
    'Checkpoint every N steps and at the end; 0: at the end iff a dir is set.',
  )
  checkpoint_keep: int = _checkpoint(
    3, 'Number of latest checkpoints kept on disk.'
  )
  resume: bool = _checkpoint(
    False,
    'Continue from the newest intact checkpoint (data position and run '
    'dir too).',
  )

  # Logging.
  out_dir: str | None = _logging(
    None, "Run folder; None: runs/<timestamp>, or on --resume the checkpoint's."
  )
  eval_every: int = _logging(
    100,
    'Evaluate on the held-out split every N steps and at the end; 0: never.',
  )
  eval_batches: int = _logging(
    4, 'Batches (of `batch_size` sequences) per evaluation.'
  )
  final_loss_window: int = _logging(
    10, 'Number of last steps averaged into the reported final loss.'
  )
  tensorboard: bool = _logging(
    True, 'Write TensorBoard event files (tensorboardX) beside metrics.jsonl.'
  )
  update_norm: bool = _logging(
    False,
    "Also log the global norm of each step's update. Off by default: "
    'the norm keeps every update alive until it is reduced, which '
    'undoes the in-place weight update (19M model: 14 MB of temporaries'
    ' become 73 MB, and ~19,000 page faults a step). The gradient and '
    'parameter norms cost nothing of the kind and are always logged.',
  )
  profile_steps: str | None = _logging(
    None,
    'Trace steps a:b (a included, b not) with jax.profiler into '
    '<out_dir>/profile; None: no trace.',
  )
  progress: bool = _logging(True, 'Show a tqdm progress bar.')
  peak_tflops: float | None = _logging(
    None,
    'Peak TFLOP/s per device for MFU; None: known-chip table or CPU matmul.',
  )


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


def preset_names() -> list[str]:
  """The names of the configs under `CONFIG_DIR` (their file stems)."""
  return sorted(
    p.stem for p in CONFIG_DIR.glob('*.py') if not p.name.startswith('_')
  )


def _config_path(preset: str) -> pathlib.Path:
  """The file of a config name, or `preset` itself where it is a path."""
  if preset.endswith('.py') or os.sep in preset or os.path.isfile(preset):
    return pathlib.Path(preset).expanduser()
  return CONFIG_DIR / f'{PRESET_ALIASES.get(preset, preset)}.py'


def load_config_file(path: str | os.PathLike[str]) -> Config:
  """Runs a config file and returns what its ``get_config()`` returns.

  Args:
    path: A Python file defining ``get_config() -> Config``.

  Returns:
    The file's `Config`, its `preset` as the file set it.

  Raises:
    ConfigError: If the file cannot be run or defines no such function.
  """
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(f'_config_{path.stem}', path)
  if spec is None or spec.loader is None or not path.is_file():
    raise ConfigError(f'config file {str(path)!r} is not a readable .py file')
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # A config file is user code: report any error.
    message = f'{type(e).__name__}: {e}'.replace('\n', ' ')
    raise ConfigError(f'config file {path}: {message}') from e
  get = getattr(module, 'get_config', None)
  cfg = get() if callable(get) else None
  if not isinstance(cfg, Config):
    raise ConfigError(f'config file {path}: get_config() must return a Config')
  return cfg


def get_config(preset: str = DEFAULT_PRESET, **overrides: Any) -> Config:
  """Returns a named config, or a config file's, with field overrides.

  Args:
    preset: The name of a file under `CONFIG_DIR` (``"demo"``, ``"1b"``,
      ...; see `preset_names`) or the path of any config file.
    **overrides: Field values that replace the config's.

  Returns:
    The resulting `Config`; its `preset` is the name (for a file under
    `CONFIG_DIR`, also when given as a path) or else the path.

  Raises:
    ConfigError: If there is no such config or its file fails.
  """
  path = _config_path(preset)
  if not path.is_file():
    raise ConfigError(
      f'unknown preset {preset!r}; one of {preset_names()}, or the path of '
      'a .py config file'
    )
  if path.resolve().parent == CONFIG_DIR:
    preset = path.stem
  return dataclasses.replace(load_config_file(path), preset=preset, **overrides)


def field_groups() -> dict[str, list[str]]:
  """Maps each group of `GROUPS` to its fields, in definition order.

  The groups are what ``--help`` shows the flags under and what
  ``config.json`` nests the values in; `preset` belongs to none.
  """
  groups: dict[str, list[str]] = {group: [] for group in GROUPS}
  for field in dataclasses.fields(Config):
    if 'group' in field.metadata:
      groups[field.metadata['group']].append(field.name)
  return groups


def field_help(name: str) -> str:
  """The help text of a `Config` field (its metadata)."""
  return {f.name: f.metadata['help'] for f in dataclasses.fields(Config)}[name]


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


def _add_start_flags(parser: argparse.ArgumentParser) -> None:
  """``--config FILE`` or ``--preset NAME``: the config a run starts from."""
  start = parser.add_mutually_exclusive_group()
  start.add_argument(
    '--config',
    metavar='FILE',
    help='Python file whose get_config() returns the Config to start from '
    '(e.g. configs/1b.py); the flags below override its fields.',
  )
  start.add_argument(
    '--preset',
    choices=[*preset_names(), *PRESET_ALIASES],
    help=f'A config under configs/ by name: --preset NAME is --config '
    f'configs/NAME.py (default: {DEFAULT_PRESET}).',
  )


def build_parser() -> argparse.ArgumentParser:
  """Builds a CLI parser: the start config, then one flag per `Config` field.

  Flags are listed by group (model, data, optimizer, ...), each with its
  field's help text (field metadata) and type (its annotation). Bad flags
  raise `ConfigError` instead of exiting.
  """
  parser = _Parser(
    prog='python -m experiments.trainer',
    description='Train a byte-level decoder-only LM.',
  )
  _add_start_flags(parser)
  hints = typing.get_type_hints(Config)
  defaults = Config()
  for group_name, names in field_groups().items():
    group = parser.add_argument_group(group_name)
    for name in names:
      flag = '--' + name.replace('_', '-')
      # Flags default to None ("keep the config file's value").
      help_ = (
        f'{field_help(name)} ({DEFAULT_PRESET}: {getattr(defaults, name)})'
      )
      help_ = help_.replace('%', '%%')
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
    The config of ``--config`` or ``--preset`` (default: demo) with every
    given field flag applied.
  """
  args = vars(build_parser().parse_args(argv))
  start = args.pop('config') or args.pop('preset') or DEFAULT_PRESET
  args.pop('preset', None)
  overrides = {k: v for k, v in args.items() if v is not None}
  return get_config(start, **overrides)


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
  if not _config_path(cfg.preset).is_file():
    raise ConfigError(
      f'unknown preset {cfg.preset!r}; one of {preset_names()}, or the path '
      'of a .py config file'
    )
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
