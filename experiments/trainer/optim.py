"""The trainer's optimizer: AdamW (superoffload, device or optax) and schedule.

`make_optimizer` builds the same AdamW with every backend, with the same
clipping, weight-decay mask and gradient accumulation, so that runs differ
only in where the optimizer state lives and where its step runs.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import jax_superoffload as superoffload
from experiments.trainer import config as config_lib

ConfigError = config_lib.ConfigError

# The mesh axis ZeRO shards SuperOffload's host state over.
DATA_AXIS = 'data'


def weight_decay_mask(params: Any) -> Any:
  """Selects the parameters that get weight decay.

  Matrices (linear kernels, an untied output head) are decayed; biases, norm
  scales and embeddings (including a tied output head) are not.

  Args:
    params: A pytree of parameter arrays.

  Returns:
    A pytree of bools with the structure of `params`.
  """

  def decay(path: tuple[Any, ...], leaf: Any) -> bool:
    names = [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]
    ndim = len(getattr(leaf, 'shape', ()))
    if 'blocks' in names and ndim >= 1:
      # A scanned stack (no per-block index after "blocks") has the layer as
      # its leading axis, which is not a matrix dimension.
      after = path[names.index('blocks') + 1 :]
      first = after[0] if after else None
      index = getattr(first, 'key', getattr(first, 'idx', None))
      if not isinstance(index, int):
        ndim -= 1
    return ndim >= 2 and not any('embed' in n for n in names)

  return jax.tree_util.tree_map_with_path(decay, params)


def make_schedule(cfg: config_lib.Config) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then ``cfg.schedule`` to the floor.

  "cosine" and "linear" decay from the end of the warmup to the last step;
  "constant" stays at the peak; "wsd" (warmup-stable-decay) stays at the peak
  and decays linearly over the last ``decay_fraction`` of the steps.

  Args:
    cfg: Reads `schedule`, `learning_rate`, `warmup_steps`, `steps`,
      `min_lr_ratio` and `decay_fraction`.

  Returns:
    The learning rate as a function of the optimizer step.
  """
  peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
  warmup_steps = min(cfg.warmup_steps, cfg.steps)
  # Runs no longer than their warmup still need one step of decay.
  decay_steps = max(cfg.steps - warmup_steps, 1)
  warmup = optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
  if cfg.schedule == 'cosine':
    after = optax.cosine_decay_schedule(peak, decay_steps, floor / peak)
  elif cfg.schedule == 'linear':
    after = optax.linear_schedule(peak, floor, decay_steps)
  elif cfg.schedule == 'constant':
    after = optax.constant_schedule(peak)
  elif cfg.schedule == 'wsd':
    cooldown = max(1, round(cfg.decay_fraction * cfg.steps))
    stable = max(decay_steps - cooldown, 0)
    after = optax.join_schedules(
      [
        optax.constant_schedule(peak),
        optax.linear_schedule(peak, floor, cooldown),
      ],
      [stable],
    )
  else:
    raise ConfigError(
      f'unknown schedule {cfg.schedule!r}; one of {config_lib.SCHEDULES}'
    )
  if warmup_steps == 0:
    return after
  return optax.join_schedules([warmup, after], [warmup_steps])


# --moments as superoffload.adamw's options.
def offload_adamw(
  learning_rate: optax.ScalarOrSchedule, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
  """`superoffload.adamw`, the keywords that are `Offload` fields in one."""
  import jax_superoffload as superoffload

  fields = {f.name for f in dataclasses.fields(superoffload.Offload)}
  offload = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
  return superoffload.adamw(
    learning_rate, offload=superoffload.Offload(**offload), **kwargs
  )


MOMENT_OPTIONS = {
  'fp32': {},
  'bf16': dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
  '8bit': dict(moments_8bit=True),
}


def make_optimizer(
  cfg: config_lib.Config,
  learning_rate: optax.ScalarOrSchedule,
  mesh: Mesh | None = None,
) -> optax.GradientTransformation:
  """Builds the AdamW transformation selected by ``cfg.optimizer``.

  Args:
    cfg: Reads `optimizer`, `b1`, `b2`, `eps`, `weight_decay`,
      `clip_norm`, `grad_accum`, the SuperOffload options and `zero`.
    learning_rate: A float or a schedule (of optimizer steps).
    mesh: The training mesh; with ``cfg.zero`` SuperOffload shards its host
      state over its 'data' axis.

  Returns:
    ``jax_superoffload.adamw`` (host or ``executor="device"``) or
    ``optax.adamw`` (after ``clip_by_global_norm`` when `clip_norm` is set,
    inside ``apply_if_finite`` with `skip_nonfinite`), all with the same
    arguments, inside ``optax.MultiSteps`` when
    ``grad_accum > 1``.

  Raises:
    ConfigError: If ``cfg.optimizer`` is unknown, ``cfg.zero`` is set
      without a mesh or for optax, or the library refuses an option (its
      ValueError or TypeError, as one line).
  """
  try:
    tx = _adamw(cfg, learning_rate, mesh)
  except (ValueError, TypeError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'optimizer: {e}'.replace('\n', ' ')) from None
  if cfg.grad_accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum)
  return tx


def _adamw(
  cfg: config_lib.Config,
  learning_rate: optax.ScalarOrSchedule,
  mesh: Mesh | None,
) -> optax.GradientTransformation:
  kwargs = dict(
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mask=weight_decay_mask,
  )
  if cfg.optimizer == 'optax':
    if cfg.zero:
      raise ConfigError('--zero needs --optimizer superoffload or device')
    tx = optax.adamw(learning_rate, **kwargs)
    if cfg.clip_norm is not None:
      tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    if cfg.skip_nonfinite:
      # Never gives up: every non-finite step is dropped, as superoffload's.
      tx = optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
    return tx
  if cfg.optimizer in ('superoffload', 'device'):
    kwargs.update(
      executor='device' if cfg.optimizer == 'device' else cfg.executor,
      clip_norm=cfg.clip_norm,
      skip_nonfinite=cfg.skip_nonfinite,
      cast=cfg.cast,
      device_buckets=cfg.device_buckets or None,
      bucket_bytes=(
        None if cfg.bucket_mib is None else int(cfg.bucket_mib * 2**20)
      ),
      **MOMENT_OPTIONS[cfg.moments],
    )
    if cfg.zero:
      if mesh is None:
        raise ConfigError('--zero needs the training mesh')
      kwargs.update(mesh=mesh, shard_axis=DATA_AXIS)
    return offload_adamw(learning_rate, **kwargs)
  raise ConfigError(
    f'unknown optimizer {cfg.optimizer!r}; one of {config_lib.OPTIMIZERS}'
  )


def executor_name(cfg: config_lib.Config) -> str | None:
  """Where the optimizer step runs: None for optax, "auto" resolved."""
  if cfg.optimizer == 'optax':
    return None
  if cfg.optimizer == 'device':
    return 'device'
  # The library's own choice: on a GPU, "auto" is "ffi" only where Grace
  # Adam could be registered with the PJRT plugin.
  return superoffload.resolve_executor(cfg.executor)
