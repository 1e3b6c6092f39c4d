"""The ways to run one bucket's Adam step, behind one small protocol.

An executor `step`s a bucket (a schedule of k leaves, each with its own
master, mu and nu arrays shaped like its parameter) and, under STV, `fix`es
that step once validation has spoken: a redo with clipped gradients or a
drop. Options choose the executor once, at construction
(`stv_executors.for_name`):

- "ffi" (`Kernel`): the Grace Adam kernel as XLA host compute, on the state
  where it lives (pinned host memory), updated in place. With STV it is
  `stv_executors.PairedKernel`, whose leaves are double-buffered, or with
  bf16 and 8-bit moments `stv_executors.AfterVerdict`.
- "xla_host" (`HostMath`): the same math in `jax.numpy`, also as host
  compute; the fallback where the kernel is not registered with the
  accelerator's PJRT plugin ("auto" picks "ffi" on a GPU only where that
  registration works).
- "stream" (`Stream`): the same kernel outside host compute, ordered on
  the accelerator's stream: the handler copies the gradients (flattened on
  the device) to pinned staging, the kernel steps the state where it lives
  on the process's host threads when the stream reaches it, and the new
  weights are copied back, all in stream order (stream_launch.h). XLA's
  host compute stages every operand through buffers of its own on a GPU;
  this keeps the state out of it. Opt-in until a GPU run has measured it.
- "device" (`Device`): the MaxText-style baseline: the state lives in host
  memory between steps but is copied to the accelerator, updated there and
  copied back.
- `Resident`: device buckets, whose state lives on the device.

Every step runs per shard under ZeRO (`zero.per_shard`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import moments
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import adam_reference
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host import plugin_ffi
from jax_superoffload._src.parallel import zero as zero_lib

EXECUTORS = ('auto', 'ffi', 'stream', 'xla_host', 'device')


class LeafState(NamedTuple):
  """A bucket's state before its step, a list per field (one per leaf)."""

  master: list[jax.Array]
  mu: list[Any]  # Arrays, or moments.Blockwise for 8-bit moments.
  nu: list[Any]
  kept: list[jax.Array] | None = None  # Double-buffered leaves only.
  row: Any = None  # Double-buffered leaves: the current row.


class BucketOut(NamedTuple):
  """A bucket's new state (per leaf) and its new weights on the device."""

  master: list[jax.Array]
  mu: list[Any]
  nu: list[Any]
  # Per leaf: the new weights (fp32, or the parameter's dtype when the
  # kernel wrote low-precision copies), or the fp32 change of the master.
  weights: list[jax.Array] | None


class Bucket(NamedTuple):
  """One bucket of a step's schedule, with what its step reads."""

  index: int
  leaves: list[int]
  executor: Executor
  hyper: Hyperparams
  grads: list[jax.Array]  # As the kernel reads them (ZeRO: this shard's).
  params: list[jax.Array] | None  # The step starts from them (`reseed`).
  dtypes: list[Any]  # Each leaf's parameter dtype.
  specs: list[Any] | None  # ZeRO: each leaf's partition spec.
  # ZeRO: the specs of each leaf's moments (8-bit: moments.Blockwise of the
  # codes' and the scales' specs); None without ZeRO.
  moment_specs: list[Any] | None
  want_delta: bool  # No params: return new - old master.
  fp32_weights: bool  # The new weights are the new fp32 masters.


class Verdict(NamedTuple):
  """What STV's validation said of a step (stv.py), which `fix` reads."""

  redo: jax.Array  # Take the step again with gradients times `scale`.
  skip: jax.Array  # Drop the step.
  scale: jax.Array
  norm: jax.Array


class Executor(Protocol):
  """How a bucket's step runs."""

  name: str
  paired: bool  # Double-buffered state (STV on the kernel).

  def step(self, zero, b: Bucket, state: LeafState) -> Any:
    """The step: a `BucketOut` (or what `fix` takes, for STV executors)."""

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    """`out` after STV's verdict: redone from `before`, dropped, or kept."""


def resolve(executor: str) -> str:
  """Validates an executor name and resolves "auto" for the backend."""
  if executor not in EXECUTORS:
    raise ValueError(f'executor must be one of {EXECUTORS}, got {executor!r}')
  backend = jax.default_backend()
  if executor == 'stream' and backend not in ('cpu', 'gpu'):
    raise ValueError(
      f'executor="stream" runs on the CPU and CUDA backends, not {backend!r}'
    )
  if executor == 'stream' and backend == 'gpu':
    filed, why = grace_adam.stream_registration()
    if not filed:
      raise ValueError(f'executor="stream" needs the CUDA driver: {why}')
  if executor != 'auto' or backend == 'cpu':
    if executor == 'ffi' and backend != 'cpu':
      _check_host_registration()
    return 'ffi' if executor == 'auto' else executor
  # Elsewhere host compute is compiled inside the accelerator's PJRT plugin,
  # which finds the kernel only in its own registry (plugin_ffi.py). The
  # "stream" executor stays opt-in until a GPU run has measured it.
  return 'ffi' if plugin_ffi.host_registration().ok else 'xla_host'


def _check_host_registration() -> None:
  registration = plugin_ffi.host_registration()
  if not registration.ok:
    warnings.warn(
      f'executor="ffi": Grace Adam is not in the PJRT plugin\'s registry '
      f'({registration.reason}); XLA may not find it in host compute',
      stacklevel=3,
    )


def reseed(
  master: jax.Array, param: jax.Array, learning_rate: Any = 0.0
) -> jax.Array:
  """The master where it rounds to `param`, `param` where it does not.

  The parameters are the source of truth: a master that no longer rounds
  to them (weights loaded, surgery, an EMA swap) restarts from them.
  """
  if param.dtype == jnp.float32:
    # The master is not read, but it must stay an input of the step: a
    # pruned input is not donated, and the new master would then need a
    # fresh buffer every step (page faults on every page of it).
    return jax.lax.optimization_barrier((master, param))[1]

  # A 16-bit update cannot always land exactly on the rounded master (a
  # weight crossing zero, or more than halving): one unit in the last place
  # away is still the weight the last step produced.
  def ordered(x):  # Adjacent floats are adjacent integers.
    bits = jax.lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32)
    return jnp.where(bits < 0, -(bits & 0x7FFF), bits)

  close = jnp.abs(ordered(master.astype(param.dtype)) - ordered(param)) <= 1
  # Nor can it when the step is larger than the weight: within its own
  # rounding (lr / 16 covers steps up to 16 lr) the parameter is the one
  # the last step produced (as ReseedTolerance in ffi_support.h).
  tolerance = jnp.abs(jnp.asarray(learning_rate, jnp.float32)) * 0.0625
  close |= jnp.abs(param.astype(jnp.float32) - master) <= tolerance
  return jnp.where(close, master, param.astype(jnp.float32))


def _math_step(hyper: Hyperparams, dtypes, master, mu, nu, grads, params):
  """The step in `jax.numpy` on whatever memory its inputs are in.

  Low-precision moments are decoded, the step taken in fp32 and the new
  moments stored rounded (bf16 to nearest even; 8-bit by `moments.py`'s
  codec), as the kernel does. `dtypes`: the new weights' dtypes, or None
  for fp32 weights (then `weights` is None).
  """
  if params is not None:
    master = [
      reseed(m, p, hyper.learning_rate)
      for m, p in zip(master, params, strict=True)
    ]
  out = [
    adam_reference.reference_step(
      hyper, m, g.astype(jnp.float32), _decoded(a, True), _decoded(v, False)
    )
    for m, g, a, v in zip(master, grads, mu, nu, strict=True)
  ]
  new_master = [o[0] for o in out]
  weights = None
  if dtypes is not None:
    weights = [m.astype(d) for m, d in zip(new_master, dtypes, strict=True)]
  return BucketOut(
    new_master,
    [_stored(o[1], a, True) for o, a in zip(out, mu, strict=True)],
    [_stored(o[2], v, False) for o, v in zip(out, nu, strict=True)],
    weights,
  )


def _decoded(moment, signed: bool) -> jax.Array:
  """A stored moment (fp32, bf16 or 8-bit blockwise) as fp32."""
  if isinstance(moment, moments.Blockwise):
    return moments.dequantize(moment, signed)
  return moment.astype(jnp.float32)


def _stored(new: jax.Array, old, signed: bool):
  """The new fp32 moment in `old`'s storage, rounded as the kernel does."""
  if isinstance(old, moments.Blockwise):
    return moments.quantize(new, signed)
  return new.astype(old.dtype)


def _kernel_step(
  hyper: Hyperparams,
  dtypes,
  master,
  mu,
  nu,
  grads,
  params,
  skip=False,
  place: grace_adam.Place | None = None,
):
  """The step by the Grace Adam kernel (in host compute, or `Stream`'s).

  `skip` (low-precision moments only): no step where it is true. `place`:
  see `grace_adam.Place`.
  """
  if all(x.dtype == jnp.float32 for x in jax.tree.leaves((mu, nu))):
    assert skip is False, 'fp32 moments are skipped by the paired kernel'
    m, a, v, w, _ = grace_adam.adam_step_segments(
      master, mu, nu, list(grads), dtypes, hyper, params=params, place=place
    )
    return BucketOut(m, a, v, None if dtypes is None else w)
  blockwise = isinstance(mu[0], moments.Blockwise)
  scales = None
  if blockwise:
    scales = ([x.scales for x in mu], [x.scales for x in nu])
    mu, nu = [x.codes for x in mu], [x.codes for x in nu]
  m, a, v, s, w, _ = grace_adam.adam_step_lowp_segments(
    master,
    mu,
    nu,
    scales,
    list(grads),
    dtypes,
    hyper,
    params=params,
    skip=skip,
    place=place,
  )
  if blockwise:
    a = [moments.Blockwise(c, x) for c, x in zip(a, s[0], strict=True)]
    v = [moments.Blockwise(c, x) for c, x in zip(v, s[1], strict=True)]
  return BucketOut(m, a, v, None if dtypes is None else w)


def _delta_or_new(b: Bucket, new_master, old_master) -> list[jax.Array]:
  """Per leaf on the device: the new master, or its change (no params)."""
  new = [host_memory.to_device(m) for m in new_master]
  if not b.want_delta:
    return new
  old = [host_memory.to_device(m) for m in old_master]
  return [n - o for n, o in zip(new, old, strict=True)]


def weight_dtypes(b: Bucket) -> list | None:
  """The dtypes the step writes the new weights in; None: fp32 masters."""
  return None if b.fp32_weights else list(b.dtypes)


def to_host_list(xs):
  return None if xs is None else [host_memory.to_host(x) for x in xs]


def scalars_to(place, xs: list) -> list:
  """Scalar (0-d) state leaves moved by `place`; the others as they are.

  Scalars live on the device between steps (see state.lives_on_host) and
  visit host memory for the host step.
  """
  return jax.tree.map(lambda x: place(x) if x.ndim == 0 else x, list(xs))


class _Plain:
  """A step that writes new buffers: the old state outlives it.

  So STV's fix redoes the step from that state, or keeps it, and runs only
  when validation says so (`lax.cond`): a step that validates pays nothing.
  """

  name = ''
  paired = False
  host_state = True  # 0-d state leaves visit host memory for the step.

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params):
    raise NotImplementedError

  def step(self, zero, b: Bucket, state: LeafState, grad_scale=None, skip=None):
    """The step; `grad_scale` scales the gradients, `skip` drops it.

    `skip` (a boolean scalar) is for the kernel's low-precision moments
    only (`stv_executors.AfterVerdict`).
    """
    hyper = b.hyper
    if grad_scale is not None:
      hyper = hyper.replace(grad_scale=grad_scale)
    fields = [list(x) for x in state[:3]]
    if self.host_state:
      fields = [scalars_to(host_memory.to_host, xs) for xs in fields]

    def fn(hyper, skip, master, mu, nu, grads, params):
      extra = {} if skip is None else {'skip': skip}
      return self.local_step(hyper, b, master, mu, nu, grads, params, **extra)

    specs, moment_specs = b.specs, b.moment_specs
    wrapped = zero_lib.per_shard(
      zero,
      fn,
      in_specs=(
        specs,
        moment_specs,
        moment_specs,
        specs,
        spec_if(b.params, specs),
      ),
      out_specs=BucketOut(specs, moment_specs, moment_specs, specs),
    )
    out = wrapped(hyper, skip, *fields, b.grads, b.params)
    if not self.host_state:
      return out
    return out._replace(
      **{
        n: scalars_to(host_memory.to_device, getattr(out, n))
        for n in ('master', 'mu', 'nu')
      }
    )

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    def redo_or_drop(out):
      def redo(_):
        return self.step(zero, b, before, grad_scale=verdict.scale)

      def drop(_):  # The weights do not matter: the updates become 0.
        return out._replace(
          master=list(before.master), mu=list(before.mu), nu=list(before.nu)
        )

      return jax.lax.cond(verdict.redo, redo, drop, None)

    return jax.lax.cond(
      jnp.logical_or(verdict.redo, verdict.skip),
      redo_or_drop,
      lambda out: out,
      out,
    )


class _OnHost(_Plain):
  """Host compute over the state where it lives, by `math`."""

  # math(hyper, weight_dtypes, master, mu, nu, grads, params) -> BucketOut
  math: Callable[..., BucketOut] = staticmethod(_math_step)

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params, **skip):
    out = host_memory.on_host(
      lambda h, skip, *xs: self.math(h, weight_dtypes(b), *xs, **skip),
      hyper,
      skip,
      master,
      mu,
      nu,
      to_host_list(grads),
      to_host_list(params),
    )
    if out.weights is None:
      return out._replace(weights=_delta_or_new(b, out.master, master))
    return out._replace(weights=[host_memory.to_device(x) for x in out.weights])


@dataclasses.dataclass(frozen=True)
class Kernel(_OnHost):
  name = 'ffi'
  math = staticmethod(_kernel_step)


def flat(x: jax.Array) -> jax.Array:
  """`x` flattened where it is, for the stream-ordered handlers.

  A gradient that a dot left column-major would otherwise reach the
  handler in a layout it does not read; rank 1 has one layout. The handler
  copies it to host memory itself where XLA left it in device memory
  (XLA:GPU elides a move to host memory whose only user is a custom call).
  """
  return x.reshape(-1)


@dataclasses.dataclass(frozen=True)
class Stream(_Plain):
  """The kernel ordered on the accelerator's stream, outside host compute."""

  name = 'stream'

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params, **skip):
    out = _kernel_step(
      hyper,
      weight_dtypes(b),
      master,
      mu,
      nu,
      grads,
      params,
      place=flat,
      **skip,
    )
    if out.weights is None:
      return out._replace(weights=_delta_or_new(b, out.master, master))
    return out._replace(weights=weights_to_device(out.weights, grads))


def weights_to_device(weights: list, like: list) -> list[jax.Array]:
  """New weights (host memory, maybe flat) on the device, shaped `like`."""
  return [
    host_memory.to_device(w).reshape(x.shape)
    for w, x in zip(weights, like, strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class HostMath(_OnHost):
  name = 'xla_host'
  math = staticmethod(_math_step)


@dataclasses.dataclass(frozen=True)
class Device(_Plain):
  """State copied to the accelerator, stepped there, copied back."""

  name = 'device'

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params):
    moved = [[host_memory.to_device(x) for x in xs] for xs in (master, mu, nu)]
    out = _math_step(hyper, weight_dtypes(b), *moved, grads, params)
    weights = out.weights
    if weights is None:
      weights = _delta_or_new(b, out.master, moved[0])
    m, a, v = ([host_memory.to_host(x) for x in xs] for xs in out[:3])
    return BucketOut(m, a, v, weights)


@dataclasses.dataclass(frozen=True)
class Resident(_Plain):
  """A device bucket: its state lives on the device."""

  name = 'resident'
  host_state = False

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params):
    out = _math_step(hyper, weight_dtypes(b), master, mu, nu, grads, params)
    if out.weights is None:
      return out._replace(weights=_delta_or_new(b, out.master, master))
    return out


RESIDENT = Resident()


def spec_if(x, spec):
  """`spec` where `x` is given, None where it is not."""
  return spec if x is not None else None
