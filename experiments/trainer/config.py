"""Configuration for the byte-level decoder-only LM trainer.

Config files follow the `ml_collections` convention of Flax's examples: a
Python file whose ``get_config()`` returns an `ml_collections.ConfigDict`,
chosen with ``--config`` and overridden field by field on the command line
(`experiments.trainer.config_cli`)::

    python -m experiments.trainer --config configs/demo.py --config.steps=50

A config file starts from `config_files.defaults` (every field at its
default) and sets the fields it changes; the named ones live under
``configs/`` at the repository root (``configs/demo.py``, ``configs/1b.py``,
...).

The code reads one flat, typed, frozen dataclass, `Config`, built from the
ConfigDict by `config_files.from_config_dict`, which checks every field's
type. Each
field carries its help text and its group (model, data, optimizer, offload,
distributed, checkpoint, logging) as field metadata: ``--help`` lists the
fields under those groups with that text, and ``config.json`` nests the
values the same way (`grouped`).

`validate` (`experiments.trainer.config_checks`) checks a config for
mistakes that can be found without touching a device; it, the parser and
`get_config` raise `ConfigError` with a one-line message.
"""

import dataclasses
import functools
import pathlib
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
# Its file.
DEFAULT_CONFIG_FILE = CONFIG_DIR / f'{DEFAULT_PRESET}.py'
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
      'help': 'Config file the other fields started from: its name for a '
      'file under configs/, else the path given to --config.'
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
    'superoffload: where its step runs: "auto", "ffi", "stream", "xla_host", '
    '"device".',
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
  overlap_scan: bool = _offload(
    True,
    'superoffload "stream", scanned blocks: start each layer\'s host step '
    "inside the backward loop (superoffload.overlap_scan). Each layer's "
    'gradients then stay in device memory until its step starts.',
  )
  consume_gradients: bool = _offload(
    False,
    'superoffload overlap_scan: the host steps write the new weights over '
    'the stacked gradients, which reach the device during the backward '
    'pass (the fastest form on a GPU); the step then logs no grad_norm.',
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
    'jax.distributed: "off" (one process unless coordinator is set)'
    ' or "auto" (the cluster auto-detection of '
    'jax.distributed.initialize: SLURM, Open MPI, Cloud TPU; explicit '
    'flags below override it).',
  )
  coordinator: str | None = _distributed(
    None, 'Coordinator "host:port" (process 0\'s host); starts jax.distributed.'
  )
  coordinator_bind: str | None = _distributed(
    None,
    'Where process 0\'s coordination service listens, "host:port" (it has '
    'no authentication); None: $JAX_COORDINATOR_BIND_ADDRESS if set, else '
    'loopback for a loopback coordinator, else every interface.',
  )
  num_processes: int | None = _distributed(
    None, 'Number of processes of the run (with coordinator).'
  )
  process_id: int | None = _distributed(
    None, "This process's id in [0, num_processes) (with coordinator)."
  )
  heartbeat_timeout_s: int = _distributed(
    100,
    'Seconds of silence after which a process counts as hung and every '
    "process stops (exit 4; a dead one is caught at once); XLA's own "
    'heartbeat timeout is twice this.',
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
    None, "Run folder; None: runs/<timestamp>, or on resume the checkpoint's."
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
EXECUTORS = ('auto', 'ffi', 'stream', 'xla_host', 'device')
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


def field_groups() -> dict[str, list[str]]:
  """Maps each group of `GROUPS` to its fields, in definition order.

  The groups are what ``--help`` shows the fields under and what
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


def field_type(name: str) -> tuple[type, bool]:
  """A field's type without ``| None``, and whether it may be None."""
  tp = typing.get_type_hints(Config)[name]
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0], True
  return tp, False


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


def validate(cfg: Config) -> None:
  """Checks a config without a device: `config_checks.validate`."""
  from experiments.trainer import config_checks  # It imports this module.

  config_checks.validate(cfg)


def config_from_args(argv: Sequence[str] | None = None) -> Config:
  """Parses command-line flags: `config_cli.config_from_args`."""
  from experiments.trainer import config_cli  # It imports this module.

  return config_cli.config_from_args(argv)


def get_config(preset: str = DEFAULT_PRESET, **overrides: Any) -> Config:
  """A named config or a config file's: `config_files.get_config`."""
  from experiments.trainer import config_files  # It imports this module.

  return config_files.get_config(preset, **overrides)
