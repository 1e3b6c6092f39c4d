"""The hooks of `overlap_scan`'s layer stacks: rows started in the loop.

`weight_flow_scan` calls `acquire` on a stack before its scan and `hook`
on each layer's weights inside it (through `core/layer_hooks.py`); while
a scope is open, the layer's backward starts its host steps on the row of
the stacked state (see scan_overlap.py for what starts and why).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import row_backward
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host import steps
from jax_superoffload._src.optim import scan_scope
from jax_superoffload._src.optim import weights_digest


def _matched(
  scope: scan_scope.Scope, tree: Any, params_path: Any, pool: dict, rows
):
  """Positions in `tree`'s leaves to start, and their leaf ids.

  `tree` is a layer's weights (`rows` None) or the stack of `rows` layers;
  `pool` the stacks its leaves may take (leaf id to master, mu, nu).

  Raises:
    ValueError: If no leaf of `tree` is a parameter at `params_path`.
  """
  prefix = scan_scope.as_path(params_path)
  with_paths = jax.tree.leaves_with_path(tree)
  found = [scope.paths.get(prefix + scan_scope.names(p)) for p, _ in with_paths]
  if not any(i is not None for i in found):
    raise ValueError(
      f'weight_flow_scan: no leaf of the stack is a parameter at params_path '
      f'{prefix!r} of the tree overlap_scan was opened with (the stack has '
      f'{[jax.tree_util.keystr(p) for p, _ in with_paths][:4]}...)'
    )
  take = []
  for j, (i, (_, x)) in enumerate(zip(found, with_paths, strict=True)):
    if i not in pool:
      continue
    shape = pool[i][0].shape
    # A cast stack is not the parameters.
    same = jnp.result_type(x) == jnp.result_type(scope.params[i])
    if same and jnp.shape(x) == (shape if rows is not None else shape[1:]):
      take.append(j)
  return take, [found[j] for j in take]


def _start(
  scope: scan_scope.Scope, ids: list[int], hypers, stacks, grads, row, held=None
):
  """Row `row`'s host steps of leaves `ids`, in `scan_scope.calls`'s calls.

  `grads` are the row's gradients, or with `held` (per call, its scalar
  operands and row cursor, `rows`) the stacked ones, which come back
  passed through the calls: the gradients, as the loop goes on.

  Raises:
    ValueError: If a leaf's rows were started already in this scope (the
      stack used twice in the loss, or a second gradient taken): each
      would step the state once more.
  """
  again = sorted(scope.started.intersection(ids))
  if again:
    raise ValueError(
      'overlap_scan: the host steps of parameter '
      f'{scope.plan.lay.paths[again[0]]} started twice in one scope (its '
      'stack used twice in the loss, or a second gradient taken); open one '
      'scope per gradient, and run a shared stack once per step'
    )
  grads = list(grads)
  calls = scan_scope.calls(scope, ids)
  for c, ((_, js), hyper) in enumerate(zip(calls, hypers, strict=True)):
    scalars, cursor = held[c] if held is not None else (None, row)
    picked = [grads[j] for j in js]
    # A stacked gradient is staged a row at a time.
    row_shapes = [
      _row_shape(g, stacks[j][0]) for g, j in zip(picked, js, strict=True)
    ]
    scope.reserve = max(scope.reserve, steps.staged_bytes(row_shapes, None))
    # A call's leaves all have host weights, or none do (`calls`); held
    # rows write theirs over the gradients instead.
    weights = (
      []
      if held is not None
      else [stacks[j][3] for j in js if len(stacks[j]) > 3]
    )
    out = grace_adam.adam_step_row(
      *([stacks[j][r] for j in js] for r in range(3)),
      picked,
      cursor,
      hyper,
      weights=weights or None,
      place=steps.stream_place(None, scope.reserve),
      scalars=scalars,
      weights_over_grads=held is not None,
    )
    for j, g in zip(js, out, strict=True):
      grads[j] = g
  scope.started.update(ids)
  return grads


def _row_shape(grad: Any, master: Any) -> Any:
  """One row of `grad` where it is stacked like `master`, else `grad`."""
  if jnp.shape(grad) != jnp.shape(master):
    return grad
  return jax.ShapeDtypeStruct(jnp.shape(grad)[1:], jnp.result_type(grad))


# Where the rows read their gradients, for every scope (for experiments,
# read at trace time): 'layer', as the scope asks (the default); 'held',
# the stack's, through a backward loop of the library's own, writing the
# new weights over it, as `consume_gradients=True` asks.
ROWS_ENV = 'JAX_SUPEROFFLOAD_SCAN_ROWS'
ROWS_CHOICES = ('layer', 'held')


def rows_from_env() -> str:
  """The rows' gradient source `ROWS_ENV` names ('layer' when unset).

  Raises:
    ValueError: Naming the variable and its value, for any other value.
  """
  value = os.environ.get(ROWS_ENV, 'layer')
  if value not in ROWS_CHOICES:
    raise ValueError(
      f'{ROWS_ENV}={value!r}: must be one of {ROWS_CHOICES} (unset: layer)'
    )
  return value


def _consumes(scope: scan_scope.Scope) -> bool:
  """Whether `scope`'s rows write the new weights over the gradients."""
  return scope.consume or rows_from_env() == 'held'


def rows(stacked: Any, params_path: Any) -> tuple | None:
  """``(on_row, aux, sinks)`` for a stack whose backward loop is ours.

  None unless the scope consumes the gradients (`overlap_scan`'s
  `consume_gradients`, or ``JAX_SUPEROFFLOAD_SCAN_ROWS=held``).
  `row_backward.scan` calls ``on_row(aux, grads, i)`` with the stacked
  gradient once its row ``i`` is in, and the acquired leaves' row steps
  read that row from the stack, which the loop keeps, with each call's
  scalars (made here, before the loop) and row cursor (`acquire`'s). On
  a GPU the worker fetches the row when the step runs, and the start
  holds its inputs, so the compute stream waits for nothing before the
  join. Each step then writes the row's new weights over it (its worker
  copies them back), so the loop leaves the new weights, not the
  gradient: the leaf's sink takes that buffer (`scope.written`), which
  `finish` holds until the join and hands on as the weights, and the
  gradient the caller gets is a `row_backward.consumed_gradient`, which
  only `update` may take. The numbers are the layer hooks' (the CPU reads
  and writes the row in place); docs/gpu.md has what it gives, compiled.
  """
  scope = scan_scope.CURRENT.get()
  if scope is None or scan_scope.as_path(params_path) not in scope.active:
    return None
  if not _consumes(scope):
    return None
  leaves = jax.tree.leaves(stacked)
  if not any(_traced(x) for x in leaves):
    return None  # Eager: nothing would drop the consumed gradient.
  take, ids = _matched(
    scope, stacked, params_path, scope.stacks, jnp.shape(leaves[0])[0]
  )
  if not take:
    return None
  stacks = [scope.stacks[i] for i in ids]
  hypers = [scope.hyper[g] for g, _ in scan_scope.calls(scope, ids)]
  cursors = scope.cursors.get(scan_scope.as_path(params_path))
  if cursors is None or len(cursors) != len(hypers):
    return None  # Not the calls `acquire` made cursors for.
  # Made before the loop and held until the join (`finish`): each call's
  # scalars and its row cursor.
  place = steps.stream_place(None, scope.reserve)
  scalars = [grace_adam.scalar_operands(h, place) for h in hypers]
  held = list(zip(scalars, cursors, strict=True))
  scope.held_operands += jax.tree.leaves(held)

  def on_row(aux, grads, row):
    stacks, hypers, held = aux
    values, treedef = jax.tree.flatten(grads)
    picked = [values[j] for j in take]
    out = _start(scope, ids, hypers, stacks, picked, row, held)
    for j, g in zip(take, out, strict=True):
      values[j] = g
    return jax.tree.unflatten(treedef, values)

  return on_row, (stacks, hypers, held), _sinks(scope, leaves, take, ids)


def _sinks(scope: scan_scope.Scope, leaves: list, take: list, ids: list):
  """Per leaf of a stack, the `row_backward.scan` sink of a consumed one.

  Leaves `leaves[take[k]]`, ids `ids[k]`, are consumed: the loop's buffer
  goes to `scope.written`; the others have None.
  """
  sinks = [None] * len(leaves)
  for j, i in zip(take, ids, strict=True):
    sinks[j] = (
      row_backward.sink(leaves[j], functools.partial(_written, scope, i)),
      _consumed_why(scope, i),
    )
  return sinks


def _written(scope: scan_scope.Scope, i: int, buffer: jax.Array) -> None:
  """Notes `buffer`, where leaf `i`'s rows wrote its new weights."""
  scope.written[i] = buffer


def _consumed_why(scope: scan_scope.Scope, i: int) -> str:
  """What reading leaf `i`'s consumed gradient raises."""
  return (
    f'overlap_scan: the gradient of {scope.plan.lay.paths[i]} went to its '
    "layers' host steps, which wrote the new weights over it: only "
    'tx.update may take it, as it is (nothing may read it, and a jit '
    'with keep_unused=True keeps it). Read it in a scope opened with '
    f'consume_gradients=False (the default; unset {ROWS_ENV})'
  )


def acquire(stacked: Any, params_path: Any, unroll: Any, inputs: Any) -> Any:
  """`stacked`, its leaves' state handed to the row steps, once.

  Called before the stack's scan: the state passes through the join (see
  the module doc), outside the loop, and the layers' rows then write it.
  The stack passes through an identity whose backward notes the gradient
  each leaf leaves the scan with. Only a rolled loop of two layers or
  more starts rows: unrolled (or a loop XLA may inline), the row steps'
  writes, which XLA does not see, could land in a buffer it copied. Nor
  does a scan of per-example `inputs` (its carry and xs under a `vmap`):
  its rows would step once per example.
  """
  scope = scan_scope.CURRENT.get()
  leaves = jax.tree.leaves(stacked)
  rolled = unroll is False or (unroll is not True and unroll == 1)
  if scope is None or not leaves or not rolled or _per_example(inputs):
    return stacked
  rows = jnp.shape(leaves[0])[0]
  if rows < 2:
    return stacked
  take, ids = _matched(scope, stacked, params_path, scope.candidates, rows)
  values = jax.tree.leaves(stacked)
  if not take or any(
    _primal(values[j]) is not scope.params[i]
    for j, i in zip(take, ids, strict=True)
  ):
    # Not the parameters themselves (weights perturbed or moved before
    # the scan): the rows would re-seed from other weights than update.
    return stacked
  fresh = [i for i in ids if i not in scope.stacks]
  flat = [scope.candidates[i][r] for r in range(3) for i in fresh]
  cursors = _cursors(scope, fresh, rows)
  if cursors:
    scope.cursors[scan_scope.as_path(params_path)] = cursors
  joined, _ = grace_adam.join_rows(flat, jnp.zeros((), jnp.int32))
  n = len(fresh)
  masters = _reseeded(scope, fresh, joined[:n])
  for j, i in enumerate(fresh):
    stack = (masters[j], joined[n + j], joined[2 * n + j])
    scope.stacks[i] = stack + _host_weights(scope, i)
  scope.active.add(scan_scope.as_path(params_path))
  return _noted(scope, stacked, take, ids)


def _cursors(scope: scan_scope.Scope, ids: list[int], rows: int) -> list:
  """Per row call of leaves `ids`, its row cursor, set to L, if held.

  Only where the scope consumes the gradients (`rows`).
  """
  if not ids or not _consumes(scope):
    return []
  return [grace_adam.row_cursor(rows) for _ in scan_scope.calls(scope, ids)]


def _host_weights(scope: scan_scope.Scope, i: int) -> tuple:
  """Leaf `i`'s 16-bit host stack for the rows' new weights, if it has one.

  A copy of the parameters to pinned host memory (`scan_scope.host_weights`),
  a buffer of the step's own, which the rows write a row at a time. Not
  through the join before the loop: XLA finishes such a copy late, and
  the join would follow it past the first bucket's start, which it then
  waits for.
  """
  if not scan_scope.host_weights(scope.params[i]):
    return ()
  return (host_memory.to_host(scope.params[i]),)


def _reseeded(scope: scan_scope.Scope, ids: list[int], masters: list) -> list:
  """`masters` (leaves `ids`' stacks) re-seeded from the scope's params.

  Before the loop (`grace_adam.reseed_rows`), so that the rows step
  without parameters: inside the loop a layer's parameters are a
  temporary, copied to the host with each row's start on the compute
  stream's time; here the stack is alive, and the worker reads it only if
  it is not the weights the last step produced. That is decided on the
  device, per group of leaves (`weights_digest.groups`): their digest
  against the state's, as the buckets decide. After the join before the
  loop, whose wait (on a GPU) then has no re-seed to wait for.
  """
  new = dict(zip(ids, masters, strict=True))
  for group in weights_digest.groups([[i] for i in ids]):
    stacked = [scope.params[i] for i in group]
    unchanged = False
    if scope.digest is not None:
      unchanged = weights_digest.unchanged(scope.digest, stacked, group)
    scope.row_groups.append(group)
    for g, js in scan_scope.by_decay_group(scope, group):
      leaves = [group[j] for j in js]
      # The staging bound (`scope.reserve`) already covers a decay group's
      # rows (`scan_scope._rows_staging`).
      out = grace_adam.reseed_rows(
        [new[i] for i in leaves],
        [scope.params[i] for i in leaves],
        scope.hyper[g],
        params_unchanged=unchanged,
        place=steps.stream_place(None, scope.reserve),
      )
      new.update(zip(leaves, out, strict=True))
  return [new[i] for i in ids]


def _primal(x: Any) -> Any:
  """`x` without the differentiation tracers around it (their primal)."""
  while isinstance(x, jax.core.Tracer) and hasattr(x, 'primal'):
    x = x.primal
  return x


def _traced(x: Any) -> bool:
  """Whether `x`, under any other tracer, is a value a `jit` traces.

  Not an eager value. By the tracer's class name, as `_per_example` (JAX
  exports no test).
  """
  while isinstance(x, jax.core.Tracer):
    if 'Jaxpr' in type(x).__name__:
      return True
    x = getattr(x, 'primal', getattr(x, 'val', None))
  return False


def _per_example(tree: Any) -> bool:
  """Whether a leaf of `tree` is a `vmap`'s value, under any other tracer.

  By the tracer's class name: JAX exports no test for it.
  """
  for x in jax.tree.leaves(tree):
    while isinstance(x, jax.core.Tracer):
      if type(x).__name__ == 'BatchTracer':
        return True
      x = getattr(x, 'primal', getattr(x, 'val', None))
  return False


def _noted(
  scope: scan_scope.Scope, stacked: Any, take: list[int], ids: list[int]
):
  """`stacked`, whose backward notes its leaves' cotangents in `scope`."""

  @jax.custom_vjp
  def noted(xs):
    return xs

  def forward(xs):
    return xs, None

  def backward(_, cts):
    for i, ct in zip(ids, cts, strict=True):
      scope.cotangents[i] = ct
    return (cts,)

  noted.defvjp(forward, backward)
  return _through(noted, stacked, take)


def _through(fn, tree: Any, take: list[int], *args: Any) -> Any:
  """`tree` with its leaves at `take` replaced by `fn(those leaves, *args)`."""
  values, treedef = jax.tree.flatten(tree)
  out = fn([values[j] for j in take], *args)
  for j, x in zip(take, out, strict=True):
    values[j] = x
  return jax.tree.unflatten(treedef, values)


def note_moved(scope: scan_scope.Scope, x: Any, y: Any) -> None:
  """Notes `y`, a copy of `x` in another memory (a gradient or a param)."""
  for i, ct in list(scope.cotangents.items()):
    if x is ct:
      scope.moves.setdefault(i, []).append(y)
  for i, p in enumerate(scope.params):
    if x is p:
      scope.param_moves.setdefault(i, []).append(y)


def hook(layer_params: Any, row: jax.Array, params_path: Any) -> Any:
  """`layer_params`, whose backward starts the layer's host steps.

  Called by `weight_flow_scan` on each layer's weights in device memory
  (weight flow: the stacks live in host memory), with the loop's counter
  `row`. Outside an active scope, or for a stack `acquire` did not take,
  it returns `layer_params` as they are. The rows step the masters that
  `acquire` re-seeded from the stack, which it saw is the parameters the
  scope was opened with. Each large leaf's call takes its gradient as soon
  as the layer's backward has it (`scan_scope.calls`); the small leaves'
  wait for the last of them.
  """
  scope = scan_scope.CURRENT.get()
  if scope is None or scan_scope.as_path(params_path) not in scope.active:
    return layer_params
  take, ids = _matched(scope, layer_params, params_path, scope.stacks, None)
  if not take:
    return layer_params
  stacks = [scope.stacks[i] for i in ids]
  hypers = [scope.hyper[g] for g, _ in scan_scope.calls(scope, ids)]

  @jax.custom_vjp
  def started(weights, row, stacks, hypers):
    del row, stacks, hypers
    return weights

  def forward(weights, row, stacks, hypers):
    # The state and scalars are primal inputs, not closures: a rule may
    # not close over the jit's tracers.
    return weights, (row, stacks, hypers)

  def backward(res, grads):
    row, stacks, hypers = res
    _start(scope, ids, hypers, stacks, grads, row)
    small = [not scan_scope.own_call(scope, i) for i in ids]
    return _not_copied(grads, row, small), None, None, None

  started.defvjp(forward, backward)
  return _through(started, layer_params, take, row, stacks, hypers)


def _not_copied(grads: list, row: jax.Array, small: list) -> list:
  """`grads`, the `small` fp32 ones through a select XLA cannot fold.

  The row call reads an fp32 leaf's gradient at fp32, so XLA makes a
  small one (a bias's, from a bf16 sum) in fp32 once, for the call and
  for the scan's update of the stacked gradient, which then only copies
  it instead of converting it. XLA:GPU runs such a copying update
  asynchronously (dynamic-slice-copy-fusion-async-wrapper), and its
  latency-hiding scheduler moves the layer's backward around the copies:
  activations and the MLP's gradients stay live through the attention's
  backward (1B on an H200: 0.72 GB more at the peak). Selected on the
  loop's counter (never negative), the update computes, and stays where
  it was. A select, not a product with one: XLA:CPU flushes subnormals
  in a product, a select keeps every bit. Left alone: the large leaves
  (XLA would compute their gradient again in the update, and a split-K
  dot's partial sums wait for it: 2 layers of 256 on an H200, 2.8 MB
  more) and the bf16 and f16 ones (the same step without the scope
  copies them too; 2 layers of 256 would need 1.5 MB more).
  """
  kept = row >= 0  # Always true; XLA does not know it.
  return [
    jnp.where(kept, g, jnp.zeros_like(g)) if s and g.dtype == jnp.float32 else g
    for g, s in zip(grads, small, strict=True)
  ]
