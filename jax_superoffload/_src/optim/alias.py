"""The public optimizers: `adam` and `adamw`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

from jax_superoffload._src.optim import transform
from jax_superoffload._src.planning.hardware import HardwareProfile


def adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any | None = None,
  *,
  nesterov: bool = False,
  nu_dtype: Any | None = None,
  moments_8bit: bool = False,
  bucket_bytes: int | None = None,
  executor: str = 'auto',
  clip_norm: float | None = None,
  skip_nonfinite: bool = False,
  device_buckets: int | float | str | None = None,
  arrival_order: Sequence[str] | None = None,
  cast: str = 'host',
  hardware: HardwareProfile | None = None,
  mesh: jax.sharding.Mesh | None = None,
  shard_axis: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose state lives in host memory and whose step runs on the CPU.

  A drop-in replacement for `optax.adam` with the same arguments and the
  same numbers (up to fp32 rounding). The first and second moments and an
  fp32 master copy of the weights live in pinned host memory, as trees
  shaped like the parameters (see `SuperOffloadState`); each step moves the
  gradients to the host, runs the fused Grace Adam kernel there (XLA host
  compute) over a few leaves per call and brings the new weights back in
  the parameters' dtype. Parameters passed to `update` that no longer
  round to the master (weights loaded, surgery) are where the step
  starts. The accelerator keeps only the parameters, the gradients and the
  activations.

  With :math:`g_t` the gradient, :math:`t` the step (from 1):

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
    \hat m_t = m_t / (1-\beta_1^t), \quad \hat v_t = v_t / (1-\beta_2^t), \\
    w_t = w_{t-1} - \eta_t\, \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}}
    + \epsilon),

  on the fp32 master :math:`w`; with ``nesterov=True``,
  :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t /
  (1-\beta_1^t)`. The returned updates satisfy
  ``optax.apply_updates(params, updates) == new_master.astype(params.dtype)``
  leaf by leaf, so bf16 or f16 parameters track an fp32 master exactly as
  mixed-precision training does.

  Args:
    learning_rate: A float or an optax schedule of the step count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Added to the denominator outside the square root.
    eps_root: Added to the second moment inside the square root.
    mu_dtype: Dtype of the first moment, as in optax: `None` or float32
      (fp32), or bfloat16 (stored rounded to nearest even, 2 B/param less
      host memory and traffic), use the kernel; any other floating or
      complex dtype takes the optax path (state still in host memory).
      A deliberate difference from optax: with `None`, bf16 and f16
      parameters get fp32 moments (optax keeps them in the parameters'
      dtype). They are the moments of the fp32 master, and a 16-bit `nu`
      loses every change below its precision: a step moves `nu` by
      `1 - b2` = 1e-3 of the gap to :math:`g^2`, under bf16's 2^-9 relative
      rounding. Pass `mu_dtype` (and `nu_dtype`) for 16-bit moments.
    nesterov: Use the Nesterov (NAdam) momentum.
    nu_dtype: Dtype of the second moment on the kernel: `None` or float32,
      or bfloat16 (needs `mu_dtype=jnp.bfloat16`).
    moments_8bit: Store mu and nu in 8 bits per element with one fp32
      scale per block of 256 (blockwise quantization, as in 8-bit Adam):
      about 6 B/param of host state instead of 12 with the master, and 18
      instead of 28 bytes moved per step. The step decodes the moments,
      updates in fp32 and encodes them again (`moments.py` gives the code
      maps; "xla_host", "device" and device buckets use its `jax.numpy`
      codec). Under ZeRO or sharded parameters a leaf is split only into
      shards of whole blocks (a leading-dimension split); others are
      stepped whole on every device.
    bucket_bytes: About how many fp32 bytes of state one kernel call steps
      (default 256 MiB); the number of kernel calls per step is the number
      of buckets. Only a schedule: the state does not depend on it.
      `None` rather than a number by default so that
      `optax.inject_hyperparams` does not turn it into an array.
    executor: Where the update runs: "stream" (the Grace Adam kernel on
      the process's host threads, ordered on the accelerator's stream:
      the gradients are copied to host memory, the state is stepped where
      it lives, the new weights are copied back; no XLA host compute),
      "ffi" (the same kernel as XLA host compute), "xla_host" (the same
      math in `jax.numpy` as host compute), "device" (state in host memory
      between steps, update on the accelerator: the MaxText-style
      baseline) or "auto" ("ffi" on CPU, and on an accelerator where the
      kernel registers with its PJRT plugin's host compute; "xla_host"
      elsewhere). "stream" is opt-in until a GPU run has measured it; on
      the CPU backend it gives the same bits as "ffi".
    clip_norm: If set, gradients are clipped to this global norm, with the
      result of `optax.chain(optax.clip_by_global_norm(clip_norm), ...)`,
      by speculation-then-validation: each bucket's step starts without
      waiting for the norm and is redone with scaled gradients only when
      the norm turns out to be at least `clip_norm` (counted in
      `state.redone`). The redo starts from the untouched state before the
      step, so it is exact at any clip ratio. A number, or a scalar float
      array (`optax.inject_hyperparams` may change it between steps).
    skip_nonfinite: If True, a step whose gradients hold a NaN or Inf leaves
      the parameters and the whole state (count included) as they were
      (counted in `state.skipped`). With either option on the "ffi" or
      "stream" executor and fp32 moments, each host bucket's state is
      double-buffered (+12 B/param of host memory) and its gradients are
      kept in host memory until validation (4 B/param); see
      `SuperOffloadState`.
    device_buckets: Bucket repartitioning: how many buckets keep their state
      on the accelerator and are updated there, an int, a fraction of the
      buckets, or "auto" (the planner's choice). They are the buckets whose
      gradients arrive last in backward, which have nothing left to overlap
      their host step with.
    arrival_order: The leaf paths (`jax.tree_util.keystr`) in the order
      their gradients arrive in backward; default: reverse parameter order
      (the first layers and the embeddings last).
    cast: Superchip-aware casting: "device" up-casts gradients on the
      accelerator and moves fp32 both ways (down-casting the new weights
      there), "host" moves gradients as stored and low-precision weights,
      converted by the kernel; "auto" asks the planner (link bandwidth vs
      cast throughput). Both sides give bit-identical results.
    hardware: The `HardwareProfile` the "auto" options plan for; default:
      `CPU_ONLY` on the CPU backend, `GH200` otherwise.
    mesh: With `shard_axis`, ZeRO-style data parallelism for replicated
      parameters: each state leaf is split along its first dimension
      divisible by the axis size N (in pinned host memory), so each
      device's host memory holds about 1/N of it; a leaf with no such
      dimension stays replicated. Each step constrains the gradient to
      that split on the device (the data-parallel reduction becomes a
      reduce-scatter where XLA can), runs the host step per shard under
      `shard_map`, and all-gathers the new weights on the device. Axes of
      the mesh not named hold the state replicated. Without mesh
      arguments each state leaf is split as its parameter is (FSDP, tensor
      parallel), and the step gathers neither state nor weights. `init`
      and `update` are pure: `init` reads the parameters' shardings (when
      traced, as under `jax.eval_shape`, their types), `update` the
      state's own leaves (else the parameters'), so a state restored into
      an `eval_shape` target steps as a fresh one and one transformation
      serves any number of trees. Types name a split only over explicit
      mesh axes: for parameters on auto axes, `init` types the state on the
      same devices with explicit axes (combine its leaves with the
      parameters only through `update`), and a traced `init` or a state
      restored onto the auto mesh cannot see the split (the step is then
      correct but gathers; restore such a state with the shardings it was
      saved with).
    shard_axis: The mesh axis name (or tuple of names) to shard over.

  Returns:
    An `optax.GradientTransformationExtraArgs`. `update` needs `params` to
    return exact updates; without them it returns the fp32 change of the
    master weights.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import jax_superoffload as superoffload
    >>> params = {'w': jnp.ones(3)}
    >>> tx = optax.chain(superoffload.adam(1e-3))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.ones(3)}, state, params)
    >>> optax.apply_updates(params, updates)['w']
    Array([0.999, 0.999, 0.999], dtype=float32)

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014.
    Lian et al., `SuperOffload: Unleashing the Power of Large-Scale LLM
    Training on Superchips <https://arxiv.org/abs/2509.21271>`_, 2025.
  """
  return adamw(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    mu_dtype,
    weight_decay=0.0,
    mask=None,
    nesterov=nesterov,
    nu_dtype=nu_dtype,
    moments_8bit=moments_8bit,
    bucket_bytes=bucket_bytes,
    executor=executor,
    clip_norm=clip_norm,
    skip_nonfinite=skip_nonfinite,
    device_buckets=device_buckets,
    arrival_order=arrival_order,
    cast=cast,
    hardware=hardware,
    mesh=mesh,
    shard_axis=shard_axis,
  )


def adamw(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any | None = None,
  weight_decay: optax.ScalarOrSchedule = 1e-4,
  mask: Any | None = None,
  *,
  nesterov: bool = False,
  nu_dtype: Any | None = None,
  moments_8bit: bool = False,
  bucket_bytes: int | None = None,
  executor: str = 'auto',
  clip_norm: float | None = None,
  skip_nonfinite: bool = False,
  device_buckets: int | float | str | None = None,
  arrival_order: Sequence[str] | None = None,
  cast: str = 'host',
  hardware: HardwareProfile | None = None,
  mesh: jax.sharding.Mesh | None = None,
  shard_axis: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW whose state lives in host memory and whose step runs on the CPU.

  A drop-in replacement for `optax.adamw`: `adam` (see its documentation for
  the offloading and the offload options) plus decoupled weight decay
  (Loshchilov and Hutter), applied to the fp32 master weights:

  .. math::
    w_t = w_{t-1} - \eta_t \left(\hat m_t / (\sqrt{\hat v_t +
    \epsilon_{root}} + \epsilon) + \lambda w_{t-1}\right).

  Args:
    learning_rate: A float or an optax schedule of the step count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Added to the denominator outside the square root.
    eps_root: Added to the second moment inside the square root.
    mu_dtype: Dtype of the first moment (see `adam`: `None` keeps fp32
      moments for bf16 parameters, unlike optax).
    weight_decay: The decay rate :math:`\lambda`, a float or a schedule.
    mask: As in optax: a tree (or a prefix of one) of booleans, or a
      callable returning one from the parameters; `True` leaves are decayed.
      Its leaves must be Python booleans, since they shape the buckets.
    nesterov: Use the Nesterov (NAdam) momentum.
    nu_dtype: Dtype of the second moment on the kernel (see `adam`).
    moments_8bit: 8-bit blockwise moments (see `adam`).
    bucket_bytes: State bytes per kernel call (see `adam`).
    executor: "stream", "ffi", "xla_host", "device" or "auto" (see `adam`).
    clip_norm: Global-norm clipping by speculation-then-validation (see
      `adam`).
    skip_nonfinite: Drop steps with NaN/Inf gradients (see `adam`).
    device_buckets: Buckets kept and updated on the device (see `adam`).
    arrival_order: Order in which gradients arrive (see `adam`).
    cast: "device", "host" or "auto" (see `adam`).
    hardware: Profile for the "auto" options (see `adam`).
    mesh: ZeRO-style sharding of the state over `shard_axis` (see `adam`).
    shard_axis: The mesh axis (or axes) the state is sharded over.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jax_superoffload as superoffload
    >>> tx = superoffload.adamw(1e-3, weight_decay=0.1)
    >>> state = tx.init({'w': jnp.ones(3)})

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return transform.superoffload_adam(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    mu_dtype=mu_dtype,
    weight_decay=weight_decay,
    mask=mask,
    nesterov=nesterov,
    nu_dtype=nu_dtype,
    moments_8bit=moments_8bit,
    bucket_bytes=bucket_bytes,
    executor=executor,
    clip_norm=clip_norm,
    skip_nonfinite=skip_nonfinite,
    device_buckets=device_buckets,
    arrival_order=arrival_order,
    cast=cast,
    hardware=hardware,
    mesh=mesh,
    shard_axis=shard_axis,
  )
