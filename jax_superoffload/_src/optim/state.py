"""The state of `adam` / `adamw`, and its check against a parameter tree.

The state is laid out as optax's adamw state, a tuple whose first element
is its `ScaleByAdamState`, and shaped like the parameters as that is: `mu`,
`nu` and the fp32 `master` have the parameters' tree structure and leaf
shapes and live in pinned host memory. Buckets are only the schedule:
one kernel call steps the leaves of one bucket, each on its own arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import layout
from jax_superoffload._src.core import moments
from jax_superoffload._src.optim import options as options_lib
from jax_superoffload._src.optim import placement as placement_lib
from jax_superoffload._src.optim import stv


class OffloadState(NamedTuple):
  """What `SuperOffloadState` keeps beside optax's `ScaleByAdamState`.

  Attributes:
    master: The weights the step starts from, a tree like the parameters:
      fp32 for the leaves the kernel steps, the parameters' own dtype for
      the others (float64, complex, or every leaf with a non-fp32
      `mu_dtype`). An `update` given parameters that no longer match it
      starts from the parameters.
    redone: Steps that speculation-then-validation redid with clipped
      gradients (int32 scalar).
    skipped: Steps dropped for non-finite gradients (int32 scalar).
    row: With STV on the "ffi" executor, which of the two rows of each
      double-buffered leaf is current (int32 scalar, 0 or 1); else None.
    kept_grads: With STV on the "ffi" executor, a tree like the parameters
      of the fp32 gradients the speculative step read (zero-size arrays for
      leaves that are not double-buffered); else None.
    mu_scales: With `moments_8bit`, a tree like the parameters of the
      float32 per-block scales of `mu` (whose leaves are then uint8 codes;
      `moments.py`), zero-size for leaves on optax's path; else None.
    nu_scales: Likewise for `nu`.
    placement: The device buckets and casting side `init` chose for this
      tree (a static node: no arrays), which `update` reads; None in a
      state made otherwise, for which `update` decides them itself.
    weights_digest: With the "stream" executor (without ZeRO), a uint32
      array of one row per parameter leaf, in device memory: a digest of
      the weights the master rounds to, which `update` compares with the
      parameters it is given, on the device, so that the host step copies
      them only when they changed (weights_digest.py); else None, and
      the step copies them every time. `replace(master=...)` without a
      digest clears it.
  """

  master: Any
  redone: jax.Array
  skipped: jax.Array
  row: jax.Array | None = None
  kept_grads: Any = None
  mu_scales: Any = None
  nu_scales: Any = None
  placement: placement_lib.Placement | None = None
  weights_digest: jax.Array | None = None


ADAM_FIELDS = optax.ScaleByAdamState._fields
OFFLOAD_FIELDS = OffloadState._fields
# The fields of the one flat NamedTuple the state was before it held
# optax's ScaleByAdamState (checkpoints written then have these names).
FIELDS = ADAM_FIELDS + OFFLOAD_FIELDS
# (weights_digest came later: none of those checkpoints has one.)
LEGACY_FIELDS = tuple(n for n in FIELDS if n != 'weights_digest')
HOW_TO_CONVERT = (
  'restore a checkpoint written before the state held optax.ScaleByAdamState'
  ' into superoffload.legacy_layout(target), then convert it with '
  'superoffload.from_legacy_layout(restored, target) (docs/state.md)'
)


def is_legacy(tree: Any) -> bool:
  """Whether `tree` is one state of the old layout (a dict of its fields).

  As Orbax restores it without a target: every field, or (from a Flax
  `nnx.State`) those that were not None.
  """
  return (
    isinstance(tree, Mapping)
    and set(tree) <= set(LEGACY_FIELDS)
    and {'count', 'mu', 'nu', 'master'} <= set(tree)
  )


def _read_only(part: str, name: str) -> property:
  return property(
    lambda self: getattr(getattr(self, part), name),
    doc=f'`{part}.{name}` (read-only; `replace` makes a changed state).',
  )


class SuperOffloadState(NamedTuple):
  """State of `superoffload.adam` / `adamw`, shaped like the parameters.

  Laid out as optax's adam/adamw state is: a tuple whose first element is
  an `optax.ScaleByAdamState(count, mu, nu)`, so code written for optax
  (`opt_state[0].mu`, `optax.tree_utils.tree_get(state, 'mu')`,
  `optax.tree_map_params`, `isinstance(..., optax.ScaleByAdamState)`)
  reads the moments; the rest is beside it. `state.count`, `state.mu`,
  `state.master` and every other field of either part read as attributes
  of the state too; `replace(**fields)` gives a changed state.

  Attributes:
    adam: `optax.ScaleByAdamState`: `count`, the steps taken (int32
      scalar); `mu`, the first moments, a tree like the parameters (fp32,
      or `mu_dtype`, in host memory); `nu`, the second moments, likewise.
    offload: `OffloadState`: the fp32 `master` weights, the STV counters
      and rows, the 8-bit scales and the placement.

  With STV on the "ffi" executor, the host leaves of `master`, `mu` and
  `nu` have shape `(2, *param.shape)`: row `row` is the current state, the
  other the spare the next speculative step writes (see stv.py), so
  `optax.tree_map_params` does not apply to them. `current()` (or
  `export_adam_state`) gives the current state either way.
  """

  adam: optax.ScaleByAdamState
  offload: OffloadState

  count = _read_only('adam', 'count')
  mu = _read_only('adam', 'mu')
  nu = _read_only('adam', 'nu')
  master = _read_only('offload', 'master')
  redone = _read_only('offload', 'redone')
  skipped = _read_only('offload', 'skipped')
  row = _read_only('offload', 'row')
  kept_grads = _read_only('offload', 'kept_grads')
  mu_scales = _read_only('offload', 'mu_scales')
  nu_scales = _read_only('offload', 'nu_scales')
  placement = _read_only('offload', 'placement')
  weights_digest = _read_only('offload', 'weights_digest')

  @classmethod
  def of(cls, **fields: Any) -> SuperOffloadState:
    """A state from the fields of both parts, by name."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
      raise TypeError(f'SuperOffloadState has no field(s) {unknown}')
    return cls(
      optax.ScaleByAdamState(*(fields[n] for n in ADAM_FIELDS)),
      OffloadState(**{n: fields[n] for n in OFFLOAD_FIELDS if n in fields}),
    )

  def replace(self, **fields: Any) -> SuperOffloadState:
    """This state with the named fields (of either part) replaced.

    A new `master` without a new `weights_digest` makes the digest match
    no parameters: the next step compares them with the master itself.
    """
    digest = self.weights_digest
    if (
      'master' in fields
      and 'weights_digest' not in fields
      and digest is not None
    ):
      fields['weights_digest'] = jnp.zeros_like(digest)
    return with_fields(self, **fields)

  def current(self) -> stv.HostState:
    """The current master, mu and nu, trees like the parameters."""
    if self.kept_grads is None:
      return stv.HostState(self.master, self.mu, self.nu)
    pick = lambda x, k: stv.current_row(x, k, self.row)  # noqa: E731
    return stv.HostState(
      *(
        jax.tree.map(pick, xs, self.kept_grads)
        for xs in (self.master, self.mu, self.nu)
      )
    )


def with_fields(state: SuperOffloadState, **fields: Any) -> SuperOffloadState:
  """`state` with the named fields replaced, its digest kept as it is.

  For the library's own changes of a state's memory space or types, which
  keep every value.
  """
  unknown = sorted(set(fields) - set(FIELDS))
  if unknown:
    raise TypeError(f'SuperOffloadState has no field(s) {unknown}')
  pick = lambda names: {n: fields[n] for n in names if n in fields}  # noqa: E731
  return SuperOffloadState(
    state.adam._replace(**pick(ADAM_FIELDS)),
    state.offload._replace(**pick(OFFLOAD_FIELDS)),
  )


class Bucketing(NamedTuple):
  """What the options and one parameter tree make of each leaf."""

  lay: layout.Layout
  placement: placement_lib.Placement
  on_device: frozenset[int]  # Buckets whose state lives on the device.
  paired: frozenset[int]  # Double-buffered buckets (STV on "ffi").
  bucket_of: dict[int, int]  # Leaf index to bucket id.


def bucketing_for(
  opts: options_lib.Options,
  tree: Any,
  placement: placement_lib.Placement | None = None,
) -> Bucketing:
  """The bucketing of `tree`, with `placement` (default: decided now)."""
  lay = opts.layout(tree)
  if placement is None:
    placement = opts.decide_placement(lay, tree)
  on_device = placement.device_buckets
  paired = frozenset()
  if opts.double_buffered:
    paired = frozenset(range(lay.num_buckets)) - on_device
  bucket_of = {}
  for k, leaf_ids in enumerate(buckets_of(lay)):
    for i in leaf_ids:
      bucket_of[i] = k
  return Bucketing(lay, placement, on_device, paired, bucket_of)


def buckets_of(lay: layout.Layout) -> list[list[int]]:
  """Leaf indices of each bucket, in state order."""
  return [
    [group.leaves[j] for j in bucket]
    for group in lay.groups
    for bucket in group.buckets
  ]


def leaf_state_types(opts, plan: Bucketing) -> list[tuple]:
  """Per leaf: (state shape, master dtype, mu dtype, nu dtype, paired)."""
  out = []
  shapes_dtypes = zip(plan.lay.shapes, plan.lay.dtypes, strict=True)
  for i, (shape, dtype) in enumerate(shapes_dtypes):
    k = plan.bucket_of.get(i)
    if k is None:  # optax math: optax's dtypes, no master precision.
      mu = np.dtype(opts.mu_dtype) if opts.mu_dtype is not None else dtype
      out.append((shape, dtype, mu, dtype, False))
      continue
    paired = k in plan.paired
    state_shape = (2, *shape) if paired else shape
    mu, nu = opts.moment_dtypes
    out.append((state_shape, np.dtype(np.float32), mu, nu, paired))
  return out


def scales_shape(opts, plan: Bucketing, i: int) -> tuple[int, ...] | None:
  """The shape of leaf i's 8-bit scales, None without 8-bit moments."""
  if not opts.moments_8bit:
    return None
  if i not in plan.bucket_of:  # optax's path: no scales.
    return (0,)
  return (moments.num_blocks(math.prod(plan.lay.shapes[i])),)


def host_leaf(plan: Bucketing, i: int) -> bool:
  return plan.bucket_of.get(i) not in plan.on_device


def lives_on_host(x: jax.Array, host: bool) -> bool:
  """Whether a state leaf lives in host memory.

  Scalars stay on the device: they are 4 bytes, and JAX drops the host
  memory space of 0-d results of `jnp.where`, which wrappers such as
  optax.MultiSteps apply to the state.
  """
  return host and np.ndim(x) > 0


def check_type(state: Any) -> None:
  """Refuses what is not a `SuperOffloadState`, in one line."""
  if is_legacy(state):
    raise TypeError(
      'optimizer state is a dict of the fields of the old flat layout: '
      + HOW_TO_CONVERT
    )
  if not isinstance(state, SuperOffloadState):
    raise TypeError(f'expected a SuperOffloadState, got {type(state).__name__}')


def check_state(opts, plan: Bucketing, state: Any, from_grads: bool):
  """The state's leaves, checked against the parameters leaf by leaf."""
  check_type(state)
  hint = (
    ' (without params, the layout comes from the gradients: give them the '
    "parameters' dtypes, or pass params)"
    if from_grads
    else ''
  )
  fields = {'master': state.master, 'mu': state.mu, 'nu': state.nu}
  if opts.double_buffered:
    fields['kept_grads'] = state.kept_grads
  if opts.moments_8bit != (state.mu_scales is not None):
    raise ValueError(
      'optimizer state was built with'
      + ('out' if opts.moments_8bit else '')
      + ' 8-bit moments, this transformation has moments_8bit='
      + str(opts.moments_8bit)
    )
  if opts.moments_8bit:
    fields['mu_scales'] = state.mu_scales
    fields['nu_scales'] = state.nu_scales
  out = {}
  types = leaf_state_types(opts, plan)
  for name, tree in fields.items():
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != plan.lay.treedef:
      raise ValueError(
        f'optimizer state was built for another parameter tree: state.{name} '
        f'has structure {treedef}, the parameters {plan.lay.treedef}{hint}'
      )
    for i, (x, (shape, m_t, mu_t, nu_t, paired)) in enumerate(
      zip(leaves, types, strict=True)
    ):
      want_shape = shape
      want_dtype = {'master': m_t, 'mu': mu_t, 'nu': nu_t}.get(name, np.float32)
      if name == 'kept_grads':
        want_shape = shape[1:] if paired else (0,) * (len(shape) + 2)
      if name.endswith('_scales'):
        want_shape = scales_shape(opts, plan, i)
      got = (tuple(np.shape(x)), np.dtype(x.dtype))
      if name == 'mu' and _mu_turned_floating(opts, plan, i, got[1]):
        want_dtype = got[1]
      if got != (tuple(want_shape), np.dtype(want_dtype)):
        raise ValueError(
          'optimizer state was built for another parameter tree: '
          f'state.{name} leaf {plan.lay.paths[i]} is '
          f'{got[1]}{list(got[0])}, the parameter needs '
          f'{np.dtype(want_dtype)}{list(want_shape)}{hint}'
        )
    out[name] = leaves
  if opts.zero is not None:
    _check_on_mesh(opts.zero, plan, out['master'])
  if opts.moments_8bit:  # The kernel's leaves as codes with their scales.
    for name in ('mu', 'nu'):
      scales = out.pop(f'{name}_scales')
      out[name] = [
        moments.Blockwise(x, s) if i in plan.bucket_of else x
        for i, (x, s) in enumerate(zip(out[name], scales, strict=True))
      ]
  return out


def _mu_turned_floating(opts, plan: Bucketing, i: int, dtype) -> bool:
  """Whether leaf i's `mu` is optax's after a step on a non-float leaf.

  optax.scale_by_adam makes `mu` like an integer or bool parameter
  (without `mu_dtype`); its first step leaves the floating result of its
  math there, and `nu` cast back to the parameter's dtype.
  """
  return (
    opts.mu_dtype is None
    and i not in plan.bucket_of
    and not np.issubdtype(plan.lay.dtypes[i], np.inexact)
    and np.issubdtype(dtype, np.inexact)
  )


def _check_on_mesh(zero, plan: Bucketing, leaves: list) -> None:
  """A concrete state must live on the mesh's devices (ZeRO)."""
  if not isinstance(zero.mesh, jax.sharding.Mesh):  # Traced: no devices.
    return
  devices = set(zero.mesh.devices.flat)
  for path, x in zip(plan.lay.paths, leaves, strict=True):
    sharding = getattr(x, 'sharding', None)
    if isinstance(x, jax.core.Tracer) or sharding is None:
      continue
    if set(sharding.device_set) != devices:
      raise ValueError(
        f'optimizer state leaf {path} lives on {len(sharding.device_set)} '
        f'device(s), the mesh spans {len(devices)}: build the state with '
        "this transformation's init (with the same mesh)"
      )
