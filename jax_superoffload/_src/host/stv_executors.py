"""The kernel under STV: speculative on two rows, or after the verdict.

`PairedKernel` (fp32 moments): each host leaf's master, mu and nu hold two
rows; the speculative step reads the current one and writes the other,
and `fix` redoes a clipped step in place from the untouched row (stv.py).
`AfterVerdict` (bf16 and 8-bit moments, which have no second row): the
step is taken once the verdict is known. `for_name` chooses the host
buckets' executor once, at construction.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.host import executors
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host.executors import Bucket
from jax_superoffload._src.host.executors import BucketOut
from jax_superoffload._src.host.executors import Executor
from jax_superoffload._src.host.executors import Kernel
from jax_superoffload._src.host.executors import LeafState
from jax_superoffload._src.parallel import zero as zero_lib


class Speculated(NamedTuple):
  """Double-buffered leaves after their speculative step (host memory)."""

  master: list[jax.Array]  # f32[2, *shape]: row `row` untouched.
  mu: list[jax.Array]
  nu: list[jax.Array]
  kept: list[jax.Array]  # The gradients the step read, as fp32.
  sumsq: jax.Array  # f32[1]: their sum of squares (scaled).
  weights: list[jax.Array] | None  # Per leaf; None for fp32 weights.


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

  inner: Kernel | executors.Stream = dataclasses.field(default_factory=Kernel)
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
  accelerator's stream (executors.Stream) rather than in host compute.
  """

  stream: bool = False
  paired = True

  @property
  def name(self) -> str:
    return 'stream' if self.stream else 'ffi'

  def step(self, zero, b: Bucket, state: LeafState) -> Speculated:
    stream = self.stream

    def fn(hyper, row, master, mu, nu, kept, grads, params):
      args = (hyper, b, row, master, mu, nu, kept, grads, params)
      return _speculate(*args, stream=stream)

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
        executors.spec_if(b.params, specs),
      ),
      out_specs=_speculated_specs(zero, b),
    )
    return wrapped(
      b.hyper,
      state.row,
      *(list(x) for x in state[:3]),
      executors.scalars_to(host_memory.to_host, state.kept),
      b.grads,
      b.params,
    )

  def fix(self, zero, b: Bucket, before: LeafState, out, verdict) -> BucketOut:
    stream = self.stream

    def fn(hyper, flags, out):
      row, redo, skip, scale = flags
      fixed = _validate_pair(hyper, out, row, redo, skip, scale, stream)
      return _finish_pair(b, fixed, row)

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


def _speculated_specs(zero, b: Bucket) -> Speculated:
  specs, pairs = b.specs, _pair_specs(b.specs)
  return Speculated(
    pairs,
    pairs,
    pairs,
    specs,
    zero_lib.per_shard_scalar(zero),
    None if b.fp32_weights else specs,
  )


def _speculate(
  hyper, b: Bucket, row, master, mu, nu, kept, grads, params, stream=False
):
  """STV's speculative kernel step on double-buffered leaves (see stv.py)."""
  dtypes = executors.weight_dtypes(b)
  place = executors.flat if stream else None

  def fn(hyper, row, master, mu, nu, kept, grads, params):
    m, a, v, k, sumsq, weights = grace_adam.adam_step_speculative(
      master,
      mu,
      nu,
      kept,
      row,
      list(grads),
      dtypes,
      hyper,
      params=params,
      place=place,
    )
    # On the stream the weights are flat until _finish_pair shapes them.
    return Speculated(m, a, v, k, sumsq, None if dtypes is None else weights)

  if stream:
    return fn(hyper, row, master, mu, nu, kept, grads, params)
  return host_memory.on_host(
    fn,
    hyper,
    row,
    master,
    mu,
    nu,
    kept,
    executors.to_host_list(grads),
    executors.to_host_list(params),
  )


def _validate_pair(
  hyper, out: Speculated, row, redo, skip, scale, stream=False
):
  """Redoes a clipped speculative step from its untouched row, in place."""
  place = executors.flat if stream else None

  def fn(hyper, master, mu, nu, kept, weights, flags):
    row, redo, skip, scale = flags
    return grace_adam.adam_step_validated(
      master,
      mu,
      nu,
      kept,
      row,
      weights,
      hyper,
      redo=redo,
      skip=skip,
      redo_scale=scale,
      place=place,
    )

  args = (
    hyper,
    out.master,
    out.mu,
    out.nu,
    out.kept,
    out.weights or [],
    (row, redo, skip, scale),
  )
  m, a, v, w = fn(*args) if stream else host_memory.on_host(fn, *args)
  weights = w if out.weights is not None else None
  return out._replace(master=m, mu=a, nu=v, weights=weights)


def _finish_pair(b: Bucket, out: Speculated, row) -> BucketOut:
  """Double-buffered leaves' new weights on the device, per leaf.

  The new master is the row the speculative step wrote (after a skipped
  step the weights are discarded, so it does not matter which row).
  """
  state = (out.master, out.mu, out.nu)
  if out.weights is not None:  # Shaped like the kept gradients' leaves.
    return BucketOut(
      *state,
      [
        host_memory.to_device(w).reshape(k.shape)
        for w, k in zip(out.weights, out.kept, strict=True)
      ],
    )
  row = jnp.asarray(row, jnp.int32)
  weights = []
  for pair in out.master:
    pair = host_memory.to_device(pair)
    new = jax.lax.dynamic_index_in_dim(pair, 1 - row, keepdims=False)
    if b.want_delta:
      new = new - jax.lax.dynamic_index_in_dim(pair, row, keepdims=False)
    weights.append(new)
  return BucketOut(*state, weights)


def for_name(executor: str, stv: bool, fp32_moments: bool) -> Executor:
  """The executor of host buckets for a name ("auto" resolved here).

  Under STV the kernel steps fp32 moments speculatively on two rows
  (`PairedKernel`), and low-precision moments once the verdict is known
  (`AfterVerdict`); the other executors write new buffers anyway, so the
  state before a speculative step is still there for its fix.
  """
  name = executors.resolve(executor)
  if name in ('ffi', 'stream'):
    stream = name == 'stream'
    if not stv:
      return executors.Stream() if stream else Kernel()
    if fp32_moments:
      return PairedKernel(stream=stream)
    return AfterVerdict(executors.Stream() if stream else Kernel())
  return executors.HostMath() if name == 'xla_host' else executors.Device()
