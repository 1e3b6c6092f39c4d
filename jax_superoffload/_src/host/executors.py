"""The ways to run one bucket's Adam step, behind one small protocol.

An executor `step`s a bucket (a schedule of k leaves, each with its own
master, mu and nu arrays shaped like its parameter) and, under STV, `fix`es
that step once validation has spoken: a redo with clipped gradients or a
drop. Options choose the executor once, at construction (`for_name`); the
step itself is steps.py's:

- "ffi" (`Kernel`): the Grace Adam kernel as XLA host compute, on the state
  where it lives (pinned host memory), updated in place. With STV it is
  `PairedKernel`, whose leaves are double-buffered and stepped
  speculatively, or with bf16 and 8-bit moments (no second row)
  `AfterVerdict`, which steps once the verdict is known.
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
from typing import Protocol

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host import plugin_ffi
from jax_superoffload._src.host import steps

# A bucket's types and helpers, which the executors' callers reach here.
from jax_superoffload._src.host.steps import Bucket as Bucket
from jax_superoffload._src.host.steps import BucketOut as BucketOut
from jax_superoffload._src.host.steps import LeafState as LeafState
from jax_superoffload._src.host.steps import Verdict as Verdict
from jax_superoffload._src.host.steps import scalars_to as scalars_to
from jax_superoffload._src.host.steps import spec_if as spec_if
from jax_superoffload._src.host.steps import to_host_list as to_host_list
from jax_superoffload._src.host.steps import weight_dtypes as weight_dtypes
from jax_superoffload._src.parallel import zero as zero_lib

EXECUTORS = ('auto', 'ffi', 'stream', 'xla_host', 'device')


class Executor(Protocol):
  """How a bucket's step runs."""

  name: str
  paired: bool  # Double-buffered state (STV on the kernel).

  def step(self, zero, b: Bucket, state: LeafState) -> Any:
    """The step: a `BucketOut` (or what `fix` takes, for STV executors)."""

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    """`out` after STV's verdict: redone from `before`, dropped, or kept."""


def resolve(executor: str) -> str:
  """Validates an executor name and resolves "auto" for the platform."""
  if executor not in EXECUTORS:
    raise ValueError(f'executor must be one of {EXECUTORS}, got {executor!r}')
  platform = backend.target()
  if executor == 'stream' and platform not in ('cpu', 'gpu'):
    raise ValueError(
      f'executor="stream" runs on the CPU and CUDA backends, not {platform!r}'
    )
  if executor == 'stream' and platform == 'gpu':
    filed, why = grace_adam.stream_registration()
    if not filed:
      raise ValueError(f'executor="stream" needs the CUDA driver: {why}')
  if executor != 'auto' or platform == 'cpu':
    if executor == 'ffi' and platform != 'cpu':
      _check_host_registration()
    return 'ffi' if executor == 'auto' else executor
  # On a GPU, "stream" where the CUDA driver files its handlers: compiled,
  # it alone meets the memory goal (the state never in device memory) and
  # copies nothing from host to host; host compute ("ffi", measured at
  # 0.113x optax's step on an H200) stages the state through transfer
  # buffers (docs/gpu.md). Elsewhere host compute is compiled inside the
  # accelerator's PJRT plugin, which finds the kernel only in its own
  # registry (plugin_ffi.py).
  if platform == 'gpu' and grace_adam.stream_registration()[0]:
    return 'stream'
  return 'ffi' if plugin_ffi.host_registration().ok else 'xla_host'


def _check_host_registration() -> None:
  registration = plugin_ffi.host_registration()
  if not registration.ok:
    warnings.warn(
      f'executor="ffi": Grace Adam is not in the PJRT plugin\'s registry '
      f'({registration.reason}); XLA may not find it in host compute',
      stacklevel=3,
    )


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
    only (`AfterVerdict`).
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


def _with_weights(b: Bucket, out: BucketOut, master, to_device=None):
  """`out` with its weights.

  The step's own weights, moved by `to_device` (a list to a list) where
  given, or else the exact delta of the new master from the old one.
  """
  if out.weights is None:
    return out._replace(weights=steps.delta_or_new(b, out.master, master))
  if to_device is None:
    return out
  return out._replace(weights=to_device(out.weights))


class _OnHost(_Plain):
  """Host compute over the state where it lives, by `math`."""

  # math(hyper, weight_dtypes, master, mu, nu, grads, params) -> BucketOut,
  # set with `name` by each subclass's class keywords.
  math: Callable[..., BucketOut]

  def __init_subclass__(cls, *, name: str, math: Callable[..., BucketOut]):
    super().__init_subclass__()
    cls.name = name
    cls.math = staticmethod(math)

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
    return _with_weights(
      b, out, master, lambda ws: [host_memory.to_device(x) for x in ws]
    )


@dataclasses.dataclass(frozen=True)
class Kernel(_OnHost, name='ffi', math=steps.kernel_step):
  """Grace Adam, the C++ kernel, as host compute."""


@dataclasses.dataclass(frozen=True)
class HostMath(_OnHost, name='xla_host', math=steps.math_step):
  """The same step in `jax.numpy`, as host compute."""


@dataclasses.dataclass(frozen=True)
class Stream(_Plain):
  """The kernel ordered on the accelerator's stream, outside host compute."""

  name = 'stream'

  @property
  def host_state(self) -> bool:
    # On a GPU the handler stages small (0-d) state left in device memory
    # itself, and its results are joined; on the CPU it visits host memory.
    return backend.target() != 'gpu'

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params, **skip):
    place = steps.stream_place(b.barrier, b.staging_bytes)
    dtypes = steps.joined_weight_dtypes(b) if place.join else weight_dtypes(b)
    out = steps.kernel_step(
      hyper,
      dtypes,
      master,
      mu,
      nu,
      grads,
      params,
      place=place,
      unchanged=b.unchanged,
      **skip,
    )
    if place.join:  # The join copied the new weights to the device.
      weights = steps.joined_weights(b, out.weights, grads, lambda: master)
      return out._replace(weights=weights)
    return _with_weights(
      b, out, master, lambda ws: steps.weights_to_device(ws, grads)
    )


@dataclasses.dataclass(frozen=True)
class Device(_Plain):
  """State copied to the accelerator, stepped there, copied back."""

  name = 'device'

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params):
    moved = [[host_memory.to_device(x) for x in xs] for xs in (master, mu, nu)]
    out = steps.math_step(hyper, weight_dtypes(b), *moved, grads, params)
    weights = out.weights
    if weights is None:
      weights = steps.delta_or_new(b, out.master, moved[0])
    m, a, v = ([host_memory.to_host(x) for x in xs] for xs in out[:3])
    return BucketOut(m, a, v, weights)


@dataclasses.dataclass(frozen=True)
class Resident(_Plain):
  """A device bucket: its state lives on the device."""

  name = 'resident'
  host_state = False

  def local_step(self, hyper, b: Bucket, master, mu, nu, grads, params):
    out = steps.math_step(
      hyper, weight_dtypes(b), master, mu, nu, grads, params
    )
    return _with_weights(b, out, master)


RESIDENT = Resident()


@dataclasses.dataclass(frozen=True)
class AfterVerdict:
  """STV for a step that updates its state in place: taken after the verdict.

  The kernel with low-precision moments has no double-buffered rows, so a
  speculative step would overwrite the state a redo needs (XLA would copy
  it first, a fresh buffer every step). Instead `step` does nothing and
  `fix` takes the step once the global norm is known: with the gradients
  scaled when clipped, not at all when dropped. Exact, one pass, in place;
  but the host step no longer overlaps the rest of the backward pass.
  """

  inner: Kernel | Stream = dataclasses.field(default_factory=Kernel)
  paired = False

  @property
  def name(self) -> str:
    return self.inner.name

  def step(self, zero, b: Bucket, state: LeafState) -> None:
    del zero, b, state

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    # No lax.cond: around an in-place call it makes XLA copy the state.
    # A dropped step's weights are left unwritten: its updates become 0.
    del out
    return self.inner.step(
      zero, b, before, grad_scale=verdict.scale, skip=verdict.skip
    )


@dataclasses.dataclass(frozen=True)
class PairedKernel:
  """STV on the kernel: double-buffered leaves, stepped speculatively.

  `step` reads the current row and writes the other, keeping the gradients
  it read; `fix` redoes the step in place from the untouched row when
  validation clips it (see stv.py). `stream`: both calls ordered on the
  accelerator's stream (Stream) rather than in host compute.
  """

  stream: bool = False
  paired = True

  @property
  def name(self) -> str:
    return 'stream' if self.stream else 'ffi'

  def step(self, zero, b: Bucket, state: LeafState) -> steps.Speculated:
    stream = self.stream

    def fn(hyper, row, master, mu, nu, kept, grads, params):
      args = (hyper, b, row, master, mu, nu, kept, grads, params)
      return steps.speculate(*args, stream=stream)

    specs, pairs = b.specs, _pair_specs(b.specs)
    wrapped = zero_lib.per_shard(
      zero,
      fn,
      in_specs=(
        pairs,
        pairs,
        pairs,
        specs,
        specs,
        spec_if(b.params, specs),
      ),
      out_specs=_speculated_specs(zero, b),
    )
    return wrapped(
      b.hyper,
      state.row,
      *(list(x) for x in state[:3]),
      scalars_to(host_memory.to_host, state.kept),
      b.grads,
      b.params,
    )

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    stream = self.stream
    joined = stream and steps.stream_place().join

    def fn(hyper, flags, out):
      row, redo, skip, scale = flags
      fixed = steps.validate_pair(
        hyper, out, row, redo, skip, scale, stream, b.staging_bytes
      )
      return steps.finish_pair(b, fixed, row, joined)

    specs, pairs = b.specs, _pair_specs(b.specs)
    in_spec = _speculated_specs(zero, b)
    if out.weights is None:
      in_spec = in_spec._replace(weights=None)
    wrapped = zero_lib.per_shard(
      zero,
      fn,
      in_specs=(in_spec,),
      out_specs=BucketOut(pairs, pairs, pairs, specs),
    )
    flags = (before.row, verdict.redo, verdict.skip, verdict.scale)
    return wrapped(b.hyper, flags, out)


def _pair_specs(specs):
  return None if specs is None else [zero_lib.pair_spec(s) for s in specs]


def _speculated_specs(zero, b: Bucket) -> steps.Speculated:
  specs, pairs = b.specs, _pair_specs(b.specs)
  return steps.Speculated(
    pairs,
    pairs,
    pairs,
    specs,
    zero_lib.per_shard_scalar(zero),
    None if b.fp32_weights else specs,
  )


def for_name(executor: str, stv: bool, fp32_moments: bool) -> Executor:
  """The executor of host buckets for a name ("auto" resolved here).

  Under STV the kernel steps fp32 moments speculatively on two rows
  (`PairedKernel`), and low-precision moments once the verdict is known
  (`AfterVerdict`); the other executors write new buffers anyway, so the
  state before a speculative step is still there for its fix.
  """
  name = resolve(executor)
  if name in ('ffi', 'stream'):
    stream = name == 'stream'
    if not stv:
      return Stream() if stream else Kernel()
    if fp32_moments:
      return PairedKernel(stream=stream)
    return AfterVerdict(Stream() if stream else Kernel())
  return HostMath() if name == 'xla_host' else Device()
