"""The open `overlap_scan` scope: what its layer hooks and `update` share.

`overlap_scan` (scan_overlap.py) opens a `Scope` while the train step is
traced; the hooks the layer stacks call (scan_hooks.py) start rows in it,
and `update` claims and finishes it. This module holds what both sides
read: the scope itself, which leaves it may start, and the path names.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory
from jax_superoffload._src.host import steps
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim import weights_digest

CURRENT: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
  'jax_superoffload_overlap_scan', default=None
)


# The parameter dtypes whose rows re-seed and step exactly: fp32 master
# weights on the host for each (the buckets' own reseed and rounding).
ROW_PARAM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Set on the update function of `adam` / `adamw` (alias.py).
OPTIONS_ATTRIBUTE = '_superoffload_options'
# A leaf's gradient row from which its row step is a call of its own.
OWN_CALL_BYTES = 64 * 1024


def _name(key: Any) -> Any:
  """A path key's name, whatever its kind (dict, attribute, index)."""
  for field in ('key', 'name', 'idx'):
    if hasattr(key, field):
      return getattr(key, field)
  return key


def names(path: Sequence[Any]) -> tuple:
  """A path's key names, without the ``.value`` a Flax Variable adds."""
  path = list(path)
  last = path[-1] if path else None
  if isinstance(last, jax.tree_util.GetAttrKey) and last.name == 'value':
    path.pop()
  return tuple(_name(k) for k in path)


def as_path(params_path: Any) -> tuple:
  """`weight_flow_scan`'s `params_path` as a tuple of key names."""
  if isinstance(params_path, (str, int)):
    return (params_path,)
  return names(params_path)


def _eligible(opts, plan, state, params) -> list[int]:
  """The leaves whose step `adam_step_row` takes exactly (module doc)."""
  if (
    opts.executor.name != 'stream'
    or opts.use_stv
    or opts.zero is not None
    or opts.moments_8bit
    or opts.double_buffered
  ):
    return []
  runs = [jax.tree.leaves(getattr(state, n)) for n in ('master', 'mu', 'nu')]
  skip = set(plan.lay.fallback)
  out = []
  for i, p in enumerate(params):
    if i in skip or plan.bucket_of.get(i) in plan.on_device:
      continue
    if jnp.result_type(p) not in ROW_PARAM_DTYPES or not jnp.size(p):
      continue
    if not jnp.ndim(p):
      continue
    if all(
      x.dtype == jnp.float32
      and x.shape == jnp.shape(p)
      and not host_memory.typed_on_device(x)
      for x in (run[i] for run in runs)
    ):
      out.append(i)
  return out


def host_weights(param: Any) -> bool:
  """Whether a stack's rows write its new weights into a host copy of it.

  On a GPU, for a 16-bit stack in device memory: the row steps round
  their new masters into a 16-bit stack in pinned host memory (a copy of
  the parameters made at the scope's opening), which then crosses to the
  device as 16 bits, not as the fp32 master. Elsewhere (the CPU, weight
  flow's stacks in host memory) the master is rounded after the join.
  """
  return (
    backend.target() == 'gpu'
    and jnp.result_type(param) in (jnp.bfloat16, jnp.float16)
    and host_memory.typed_on_device(param)
  )


def has_weights(scope: Scope, i: int) -> bool:
  """Whether leaf `i`'s stacks hold its 16-bit host weights (`host_weights`)."""
  return len(scope.stacks.get(i, ())) > 3


def one_device(tree: Any) -> bool:
  """Whether nothing in `tree`, nor the mesh in context, spans devices.

  XLA's SPMD partitioner wants a sharding on every side-effecting call,
  and a row step, which has no result, gets none from its operands.
  """
  meshes = [jax.sharding.get_abstract_mesh()]
  for x in jax.tree.leaves(tree):
    meshes.append(
      getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
    )
  return all(m is None or m.empty or m.size == 1 for m in meshes)


def _plan_staging(plan, params, rows: set[int], cast_on_device: bool) -> int:
  """The staging bound of the plan's host buckets (`steps.staged_bytes`).

  Without the leaves in `rows`, which the rows step a layer at a time
  (each row call, and each re-seed, raises the bound to what it stages:
  a row's worth, not the stack's). A bucket casting on the host with a
  16-bit leaf writes weights copies, which XLA may place in device memory
  (`steps.staging_bound`).
  """
  bound = 0
  for group in plan.lay.groups:
    for bucket in group.buckets:
      ids = [group.leaves[j] for j in bucket]
      on_device = plan.bucket_of.get(ids[0]) in plan.on_device
      leaves = [params[i] for i in ids if i not in rows]
      if leaves and not on_device:
        copies = not cast_on_device and any(
          jnp.result_type(params[i]) != jnp.float32 for i in ids
        )
        staged = steps.staged_bytes(leaves, leaves, leaves if copies else None)
        bound = max(bound, staged)
  return bound


def _rows_staging(group_of: dict, params, ids: list[int]) -> int:
  """A bound of what one row call or one stack's re-seed stages.

  A row call stages a row of a leaf's gradient (fp32 at most), or those
  of a decay group's small leaves; a re-seed, a row of each of its decay
  group's leaves. Taken up front, so that every launch of the step
  carries the same bound and the slots are sized once (a launch that
  stages more still grows them, in the first step only).
  """
  rows: dict[int, list] = {}
  bound = 0
  for i in ids:
    shape = jnp.shape(params[i])[1:]
    widest = jax.ShapeDtypeStruct(shape, jnp.float32)
    bound = max(bound, steps.staged_bytes([widest], None))
    row = jax.ShapeDtypeStruct(shape, jnp.result_type(params[i]))
    rows.setdefault(group_of[i], []).append(row)
  for group in rows.values():
    bound = max(bound, steps.staged_bytes(group, None))
  return bound


class Scope:
  """An open `overlap_scan`: what the hooks and `update` share while tracing."""

  def __init__(self, opts, state, params: Any, consume: bool = False):
    self.opts = opts
    self.consume = consume  # overlap_scan's consume_gradients.
    self.masters = jax.tree.leaves(state.master)
    self.plan = state_lib.bucketing_for(opts, params, state.placement)
    with_paths = jax.tree.leaves_with_path(params)
    leaves = [x for _, x in with_paths]
    self.paths = {names(p): i for i, (p, _) in enumerate(with_paths)}
    ids = _eligible(opts, self.plan, state, leaves)
    if len(leaves) != len(self.masters):
      ids = []
    self.group_of = {
      i: g for g, group in enumerate(self.plan.lay.groups) for i in group.leaves
    }
    self.hyper = {
      g: opts.hyperparams(state.count, decay=group.decay)
      for g, group in enumerate(self.plan.lay.groups)
    }
    runs = [jax.tree.leaves(getattr(state, n)) for n in ('master', 'mu', 'nu')]
    # The state of the leaves a stack may start, as given; `acquire` moves
    # those of each stack into `stacks` when the stack runs.
    self.candidates = {i: tuple(run[i] for run in runs) for i in ids}
    # Leaf id to its joined (master, mu, nu), and its 16-bit host weights
    # where it has them (`host_weights`).
    self.stacks: dict[int, tuple] = {}
    self.params = leaves  # A stack's leaves must be these (`acquire`).
    self.active: set[tuple] = set()  # The params_paths whose rows start.
    # The cotangent each started stack leaf left its scan with: update
    # must get exactly that gradient (see `check_gradients`).
    self.cotangents: dict[int, Any] = {}
    self.moves: dict[int, list] = {}  # Copies of them (`layer_hooks.moved`).
    self.param_moves: dict[int, list] = {}  # Copies of `params`, likewise.
    self.count = state.count  # The rows' step; update must get that one.
    self.reserve = 0
    if ids:
      self.reserve = max(
        _plan_staging(
          self.plan, leaves, set(ids), state.placement.cast_on_device
        ),
        _rows_staging(self.group_of, leaves, ids),
      )
    self.started: set[int] = set()
    # The operands the rows that read the stacked gradient hold until the
    # join (scalars, cursors; `scan_hooks.rows`).
    self.held_operands: list = []
    # Per consumed leaf, the buffer its rows wrote (`scan_hooks.rows`).
    self.written: dict[int, Any] = {}
    # Per stack path, its row calls' cursors (`scan_hooks.acquire`).
    self.cursors: dict = {}
    self.claimed = False
    # Where the scope was opened: `update` must be traced there too.
    self.trace = trace_state()
    # The state's digest of the parameters: a stack whose parameters have
    # it re-seeds nothing and reads none (`scan_hooks.acquire`).
    self.digest = _digest(opts, state, len(leaves)) if ids else None
    # The stack leaves digested together, as `acquire` took them: `update`
    # keeps their digest after the step in the same groups.
    self.row_groups: list[list[int]] = []


def trace_state() -> Any:
  """The trace JAX is tracing in now, comparable with an earlier one."""
  return jex_core.get_opaque_trace_state(convention='nnx')


def _digest(opts, state, num_leaves: int) -> jax.Array | None:
  """The state's `weights_digest` where the rows may use it, else None."""
  try:
    return weights_digest.checked(opts, state, num_leaves)
  except ValueError:
    return None  # `update` says what is wrong with it.


def calls(scope: Scope, ids: list[int]) -> list[tuple[int, list[int]]]:
  """The row calls of `ids`: (group, positions in `ids`).

  A leaf whose gradient row has `OWN_CALL_BYTES` or more has a call of its
  own, so its gradient is stepped, and freed, as soon as the backward has
  it: in a call shared with the layer's last gradient it would wait in
  device memory through the rest of the layer's backward (1B on an H200:
  0.15 GB more at the peak). The smaller leaves share one call per decay
  group and per whether they write host weights (`has_weights`: a call
  writes them for all of its leaves or for none).
  """
  groups: dict[tuple[int, bool], list[int]] = {}
  out = []
  for j, i in enumerate(ids):
    if own_call(scope, i):
      out.append((scope.group_of[i], [j]))
    else:
      key = (scope.group_of[i], has_weights(scope, i))
      groups.setdefault(key, []).append(j)
  return out + [(g, js) for (g, _), js in groups.items()]


def by_decay_group(scope: Scope, ids: list[int]) -> list[tuple[int, list]]:
  """Positions in `ids` by decay group: (group, positions), as `calls`."""
  groups: dict[int, list[int]] = {}
  for j, i in enumerate(ids):
    groups.setdefault(scope.group_of[i], []).append(j)
  return list(groups.items())


def own_call(scope: Scope, i: int) -> bool:
  """Whether leaf `i`'s row step is a call of its own (`calls`)."""
  stack = scope.params[i]
  row = jnp.size(stack) // jnp.shape(stack)[0]
  return row * jnp.dtype(jnp.result_type(stack)).itemsize >= OWN_CALL_BYTES
