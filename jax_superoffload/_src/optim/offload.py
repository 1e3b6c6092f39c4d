"""`Offload`: how `adam` / `adamw` offload, one frozen, validated object."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload._src.host import executors
from jax_superoffload._src.optim import placement
from jax_superoffload._src.parallel import zero as zero_lib

if TYPE_CHECKING:  # Only the type: planning is imported where it plans.
  from jax_superoffload._src.planning.hardware import HardwareProfile

DEFAULT_BUCKET_BYTES = 256 * 2**20
KERNEL_MOMENT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offload:
  """Where the state of `adam` / `adamw` lives and where its step runs.

  The choices that optax's `adamw` does not have, gathered in one frozen
  object and checked when it is made; the defaults suit one accelerator
  (or the CPU) with fp32 moments. Pass it as `adamw(..., offload=...)`:

  >>> import jax_superoffload as superoffload
  >>> offload = superoffload.Offload(executor='ffi', clip_norm=1.0)
  >>> tx = superoffload.adamw(1e-3, offload=offload)

  Attributes:
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
    executor: Where the update runs: "stream" (the Grace Adam kernel on
      the process's host threads, ordered on the accelerator's stream:
      the gradients are copied to host memory, the state is stepped where
      it lives, the new weights are copied back; no XLA host compute),
      "ffi" (the same kernel as XLA host compute), "xla_host" (the same
      math in `jax.numpy` as host compute), "device" (state in host memory
      between steps, update on the accelerator: the MaxText-style
      baseline) or "auto": "ffi" on CPU; on a GPU "stream" where the CUDA
      driver loads (compiled for an H200 it alone keeps the state out of
      device memory and copies nothing host to host; no GPU has run it
      yet, docs/gpu.md), else "ffi" where the kernel registers with the
      PJRT plugin's host compute, else "xla_host". On the CPU backend
      "stream" gives the same bits as "ffi".
    clip_norm: If set, gradients are clipped to this global norm, with the
      result of `optax.chain(optax.clip_by_global_norm(clip_norm), ...)`,
      by speculation-then-validation: each bucket's step starts without
      waiting for the norm and is redone with scaled gradients only when
      the norm turns out to be at least `clip_norm` (counted in
      `state.redone`). The redo starts from the untouched state before the
      step, so it is exact at any clip ratio. A number, or a scalar float
      array: to change it between steps, build the optimizer in a function
      of it under `optax.inject_hyperparams` (see `adamw`).
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
  """

  nu_dtype: Any = None  # None, float32 or bfloat16.
  moments_8bit: bool = False  # 8-bit blockwise mu and nu.
  bucket_bytes: int | None = None  # fp32 state bytes per kernel call.
  executor: str = 'auto'  # "auto", "ffi", "stream", "xla_host" or "device".
  clip_norm: Any = None  # None, a positive number or a scalar array.
  skip_nonfinite: bool = False  # Drop steps with NaN/Inf gradients.
  device_buckets: int | float | str | None = None  # Kept on the device.
  arrival_order: Sequence[str] | None = None  # Leaf paths, backward order.
  cast: str = 'host'  # Which side casts: "host", "device" or "auto".
  hardware: HardwareProfile | None = None  # What "auto" plans for.
  mesh: jax.sharding.Mesh | None = None  # ZeRO: the mesh, with shard_axis.
  shard_axis: str | tuple[str, ...] | None = None  # ZeRO: the axis.

  def __post_init__(self):
    zero_lib.from_mesh(self.mesh, self.shard_axis)  # Checked.
    if self.executor not in executors.EXECUTORS:
      raise ValueError(
        f'executor must be one of {executors.EXECUTORS}, got {self.executor!r}'
      )
    if self.cast not in placement.CASTS:
      raise ValueError(
        f'cast must be one of {placement.CASTS}, got {self.cast!r}'
      )
    placement.check_device_buckets(self.device_buckets)
    if self.clip_norm is not None:
      _check_clip_norm(self.clip_norm)
    check_bucket_bytes(self.bucket_bytes)
    _check_nu_dtype(self.nu_dtype, self.moments_8bit)
    if self.arrival_order is not None:  # Hashable, and kept as given.
      object.__setattr__(self, 'arrival_order', tuple(self.arrival_order))

  @property
  def use_stv(self) -> bool:
    """Whether the step speculates and validates (clipping, NaN drops)."""
    return self.clip_norm is not None or bool(self.skip_nonfinite)


def _check_clip_norm(clip_norm: Any) -> None:
  # A number, or a scalar array as optax.inject_hyperparams makes of one
  # (its value is checked unless traced: inject rebuilds us inside update).
  number = isinstance(clip_norm, (int, float)) and not isinstance(
    clip_norm, bool
  )
  # Integer arrays too: inject_hyperparams makes int32 of clip_norm=1.
  array = isinstance(clip_norm, (jax.Array, np.ndarray, np.generic)) and (
    np.ndim(clip_norm) == 0
    and (
      jnp.issubdtype(clip_norm.dtype, jnp.floating)
      or jnp.issubdtype(clip_norm.dtype, jnp.integer)
    )
  )
  if (number or array) and (
    isinstance(clip_norm, jax.core.Tracer) or clip_norm > 0
  ):
    return
  raise ValueError(
    f'clip_norm must be a positive number or a scalar real array, got '
    f'{clip_norm!r}'
  )


def check_bucket_bytes(bucket_bytes: Any) -> int:
  """`bucket_bytes` checked, with its default filled in."""
  if bucket_bytes is None:
    return DEFAULT_BUCKET_BYTES
  if (
    not isinstance(bucket_bytes, (int, np.integer))
    or isinstance(bucket_bytes, bool)
    or bucket_bytes < 4
  ):
    raise ValueError(
      f'bucket_bytes must be an integer >= 4, got {bucket_bytes!r}'
    )
  return int(bucket_bytes)


def _check_nu_dtype(nu_dtype: Any, moments_8bit: bool) -> None:
  if nu_dtype is not None and np.dtype(nu_dtype) not in KERNEL_MOMENT_DTYPES:
    raise ValueError(f'nu_dtype must be float32 or bfloat16, got {nu_dtype!r}')
  if moments_8bit and nu_dtype is not None:
    raise ValueError(
      'moments_8bit=True stores both moments in 8 bits: leave mu_dtype and '
      f'nu_dtype unset (got None, {nu_dtype!r})'
    )
