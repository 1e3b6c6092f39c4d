"""Host steps of a scanned layer stack, started inside its backward loop.

A scanned stack's gradients exist, stacked, only once the backward loop
ends, so a host step started after the loop cannot overlap the backward
pass. Inside `overlap_scan`'s scope, ``weight_flow_scan(...,
params_path=...)`` passes each layer's weights through a `custom_vjp`
whose backward rule starts that layer's host step the moment the layer's
gradient exists: `grace_adam.adam_step_row` on row ``i`` of the stacked
fp32 state, written in place, with no result. `update`, called in the same
scope, leaves those leaves out of its buckets and joins their state after
the loop (`grace_adam.join_rows`, whose barrier is the stacked gradients,
a value only the loop computes).

Only leaves whose step the row step takes exactly are started in the loop:
the "stream" executor, fp32 parameters and moments in host memory, no STV,
ZeRO, 8-bit moments or double buffering, and not in a device bucket or on
optax's path; a rolled loop (`unroll=1`) of two layers or more, whose
stack leaves are the parameters' own dtype; one device. Everything else
keeps its start after the loop, and with any other transformation
(optax's, or ours inside a wrapper such as `optax.chain` or
`optax.MultiSteps`) the scope does nothing.

The rows step with the gradient each stack leaf leaves its loop with, and
re-seed from the parameters the scope was opened with. So `update` must
get exactly that gradient (the very value, or `fetch_stacked`'s copy of
it): a leaf also used outside its scan, a stack transformed before it, a
gradient scaled, clipped or summed after it, or one from an inner `jit`,
is refused at trace time (`check_gradients`), before anything runs.

At the scope's opening, the state of those leaves passes through the join
once: the row steps then write buffers of the step's own (a state the
caller did not donate is copied there first, as the bucket steps' aliased
results are), and the buckets of `update` read the same buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layer_hooks
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host import steps
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.parallel import following

_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
  'jax_superoffload_overlap_scan', default=None
)
# Set on the update function of `adam` / `adamw` (alias.py).
OPTIONS_ATTRIBUTE = '_superoffload_options'


def _name(key: Any) -> Any:
  """A path key's name, whatever its kind (dict, attribute, index)."""
  for field in ('key', 'name', 'idx'):
    if hasattr(key, field):
      return getattr(key, field)
  return key


def _names(path: Sequence[Any]) -> tuple:
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
  return _names(params_path)


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
    if jnp.result_type(p) != jnp.float32 or not jnp.ndim(p) or not jnp.size(p):
      continue
    if all(
      x.dtype == jnp.float32
      and x.shape == jnp.shape(p)
      and not host_memory.typed_on_device(x)
      for x in (run[i] for run in runs)
    ):
      out.append(i)
  return out


def _one_device(tree: Any) -> bool:
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


def _plan_staging(plan, params) -> int:
  """The staging bound of the plan's host buckets (`steps.staged_bytes`)."""
  bound = 0
  for group in plan.lay.groups:
    for bucket in group.buckets:
      ids = [group.leaves[j] for j in bucket]
      leaves = [params[i] for i in ids]
      if plan.bucket_of.get(ids[0]) not in plan.on_device:
        bound = max(bound, steps.staged_bytes(leaves, leaves))
  return bound


class _Scope:
  """An open `overlap_scan`: what the hooks and `update` share while tracing."""

  def __init__(self, opts, state, params: Any):
    self.opts = opts
    self.masters = jax.tree.leaves(state.master)
    self.plan = state_lib.bucketing_for(opts, params, state.placement)
    with_paths = jax.tree.leaves_with_path(params)
    leaves = [x for _, x in with_paths]
    self.paths = {_names(p): i for i, (p, _) in enumerate(with_paths)}
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
    self.stacks: dict[int, tuple] = {}
    self.params = leaves  # A stack's leaves must be these (`acquire`).
    self.active: set[tuple] = set()  # The params_paths whose rows start.
    # The cotangent each started stack leaf left its scan with: update
    # must get exactly that gradient (see `check_gradients`).
    self.cotangents: dict[int, Any] = {}
    self.moves: dict[int, list] = {}  # Copies of them (`layer_hooks.moved`).
    self.reserve = _plan_staging(self.plan, leaves) if ids else 0
    self.started: set[int] = set()
    self.claimed = False


@contextlib.contextmanager
def overlap_scan(
  tx: optax.GradientTransformation, opt_state: Any, params: Any
) -> Iterator[None]:
  """Starts scanned layers' host steps inside the backward loop.

  Open it, inside the jitted train step, around the gradient and the
  optimizer's update; the layer stacks run by ``weight_flow_scan(...,
  params_path=...)`` then start each layer's host step as soon as the
  backward pass has that layer's gradient, and `tx.update` joins them::

    with superoffload.overlap_scan(tx, opt_state, params):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)

  The numbers are those of the same step without the scope, bit for bit.
  Which leaves start in the loop, and when the scope does nothing, is in
  the module's doc. One gradient per scope, and `tx.update` must receive
  it as the backward pass made it: the layers' steps have already used it
  (anything else is refused when `tx.update` is traced).

  Args:
    tx: The transformation `superoffload.adam` / `adamw` returned. Any
      other makes the scope do nothing.
    opt_state: The state `tx.update` will be given (the same arrays).
    params: The parameters `tx.update` will be given, whose paths
      `params_path` names.

  Raises:
    RuntimeError: On leaving the scope, if layers started their steps but
      `tx.update` was not called inside it.
  """
  opts = getattr(tx.update, OPTIONS_ATTRIBUTE, None)
  ours = [
    x
    for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, state_lib.SuperOffloadState)
    )
    if isinstance(x, state_lib.SuperOffloadState)
  ]
  active = opts is not None and len(ours) == 1 and opt_state is ours[0]
  if active and following.split_of(ours[0].master, params) is not None:
    active = False  # A split state steps per shard, after the loop.
  if active and not _one_device((ours[0].master, params)):
    active = False  # A row step has no result to carry a sharding.
  scope = _Scope(opts, ours[0], params) if active else None
  token = _SCOPE.set(scope)
  try:
    hooks = None
    if scope is not None:
      hooks = layer_hooks.Hooks(acquire, hook, functools.partial(_moved, scope))
    with layer_hooks.hooked(hooks):
      yield
  finally:
    _SCOPE.reset(token)
  if scope is not None and scope.started and not scope.claimed:
    raise RuntimeError(
      'overlap_scan: layers started their host steps in the backward pass, '
      'but tx.update was not called inside the scope; call it there, with '
      'the gradients and the state the scope was opened with, on the '
      'transformation the scope was opened with'
    )


def _matched(scope: _Scope, tree: Any, params_path: Any, pool: dict, rows):
  """Positions in `tree`'s leaves to start, and their leaf ids.

  `tree` is a layer's weights (`rows` None) or the stack of `rows` layers;
  `pool` the stacks its leaves may take (leaf id to master, mu, nu).

  Raises:
    ValueError: If no leaf of `tree` is a parameter at `params_path`.
  """
  prefix = as_path(params_path)
  with_paths = jax.tree.leaves_with_path(tree)
  found = [scope.paths.get(prefix + _names(p)) for p, _ in with_paths]
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
    same = jnp.result_type(x) == pool[i][0].dtype  # A cast stack is not it.
    if same and jnp.shape(x) == (shape if rows is not None else shape[1:]):
      take.append(j)
  return take, [found[j] for j in take]


def _start(scope: _Scope, ids: list[int], hypers, stacks, grads, weights, row):
  """Row `row`'s host steps of leaves `ids`: one call per decay group.

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
  for (_, js), hyper in zip(_calls(scope, ids), hypers, strict=True):
    picked = [grads[j] for j in js]
    params = [weights[j] for j in js]
    scope.reserve = max(scope.reserve, steps.staged_bytes(picked, params))
    grace_adam.adam_step_row(
      *([stacks[j][r] for j in js] for r in range(3)),
      picked,
      row,
      hyper,
      params=params,
      place=steps.stream_place(None, scope.reserve),
    )
  scope.started.update(ids)


def _calls(scope: _Scope, ids: list[int]) -> list[tuple[int, list[int]]]:
  """The row calls of `ids`: (group, positions in `ids`) per decay group."""
  groups: dict[int, list[int]] = {}
  for j, i in enumerate(ids):
    groups.setdefault(scope.group_of[i], []).append(j)
  return list(groups.items())


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
  scope = _SCOPE.get()
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
  joined, _ = grace_adam.join_rows(flat, jnp.zeros((), jnp.int32))
  n = len(fresh)
  for j, i in enumerate(fresh):
    scope.stacks[i] = (joined[j], joined[n + j], joined[2 * n + j])
  scope.active.add(as_path(params_path))
  return _noted(scope, stacked, take, ids)


def _primal(x: Any) -> Any:
  """`x` without the differentiation tracers around it (their primal)."""
  while isinstance(x, jax.core.Tracer) and hasattr(x, 'primal'):
    x = x.primal
  return x


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


def _noted(scope: _Scope, stacked: Any, take: list[int], ids: list[int]):
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


def _moved(scope: _Scope, x: Any, y: Any) -> None:
  """Notes `y`, a copy of `x` in another memory, as `x`'s gradient."""
  for i, ct in list(scope.cotangents.items()):
    if x is ct:
      scope.moves.setdefault(i, []).append(y)


def check_gradients(scope: _Scope, updates: Any) -> None:
  """Raises unless `update` got the gradients the started stacks made.

  The rows stepped with the gradient each stack leaf left its scan with;
  a gradient that is anything else (the leaf also used outside the scan,
  a loss scale, clipping, a sum over micro-batches, a transformed stack)
  would be stepped twice over, or wrongly. So it must be that very value.

  Raises:
    ValueError: Naming the first leaf whose gradient is another value.
  """
  leaves = jax.tree.leaves(updates)
  for i in sorted(scope.started):
    same = [scope.cotangents.get(i), *scope.moves.get(i, ())]
    if i >= len(leaves) or not any(leaves[i] is x for x in same):
      raise ValueError(
        'overlap_scan: the gradient update got for parameter '
        f'{scope.plan.lay.paths[i]} is not the one its stack left the '
        'backward loop with (the leaf used outside the scan too, the '
        'stack transformed before it, or the gradient changed after it: '
        'scaled, clipped, summed); its layers have stepped with the '
        "loop's. Run the step without overlap_scan"
      )


def hook(layer_params: Any, row: jax.Array, params_path: Any) -> Any:
  """`layer_params`, whose backward starts the layer's host steps.

  Called by `weight_flow_scan` on each layer's weights in device memory
  (weight flow: the stacks live in host memory), with the loop's counter
  `row`. Outside an active scope, or for a stack `acquire` did not take,
  it returns `layer_params` as they are. The rows re-seed from these
  weights, which `acquire` saw are the parameters the scope was opened
  with. The rule holds each layer's gradients until its calls, which XLA
  places at the end of the layer's backward.
  """
  scope = _SCOPE.get()
  if scope is None or as_path(params_path) not in scope.active:
    return layer_params
  take, ids = _matched(scope, layer_params, params_path, scope.stacks, None)
  if not take:
    return layer_params
  stacks = [scope.stacks[i] for i in ids]
  hypers = [scope.hyper[g] for g, _ in _calls(scope, ids)]

  @jax.custom_vjp
  def started(weights, row, stacks, hypers):
    del row, stacks, hypers
    return weights

  def forward(weights, row, stacks, hypers):
    # The state and scalars are primal inputs, not closures: a rule may
    # not close over the jit's tracers.
    return weights, (weights, row, stacks, hypers)

  def backward(res, grads):
    weights, row, stacks, hypers = res
    _start(scope, ids, hypers, stacks, grads, weights, row)
    return grads, None, None, None

  started.defvjp(forward, backward)
  return _through(started, layer_params, take, row, stacks, hypers)


def _same_options(a, b) -> bool:
  """Whether two transformations' options step the state alike.

  An equal transformation built twice counts (its options compare equal);
  options that cannot be compared (a schedule, a traced clipping norm
  built apart) count as different.
  """
  if a is b:
    return True
  try:
    return bool(a == b)
  except Exception:  # A tracer's truth value, for one.
    return False


def claim(opts, state: Any, updates: Any) -> _Scope | None:
  """The open scope `update(opts, updates, state)` finishes, if any.

  Raises:
    ValueError: If layers started their steps but `state` is not the one
      the scope was opened with, `update` is called twice in it, by a
      transformation with other options, or `updates` are not the
      gradients the rows took (`check_gradients`).
  """
  scope = _SCOPE.get()
  if scope is None:
    return None
  masters = jax.tree.leaves(state.master)
  same = len(masters) == len(scope.masters) and all(
    a is b for a, b in zip(masters, scope.masters, strict=True)
  )
  if not _same_options(scope.opts, opts):
    if scope.started and same:
      raise ValueError(
        'overlap_scan: the layers started their host steps with the options '
        'of the transformation the scope was opened with, and update was '
        'called on that state by a transformation with other options; '
        'open the scope with the transformation whose update you call'
      )
    return None
  if scope.started and (not same or scope.claimed):
    raise ValueError(
      'overlap_scan: layers started their host steps on the state the '
      'scope was opened with; update must be called once in the scope, '
      'with that state, the gradients and the parameters'
      + (' (it was called twice)' if same else ' (it got another state)')
    )
  if not same:
    return None
  scope.claimed = True
  check_gradients(scope, updates)
  return scope


def with_stacks(scope: _Scope, state: dict[str, list]) -> dict[str, list]:
  """`update`'s state runs with the scope's joined stacks in place."""
  new = {n: list(xs) for n, xs in state.items()}
  for i, stack in scope.stacks.items():
    for r, n in enumerate(('master', 'mu', 'nu')):
      new[n][i] = stack[r]
  return new


def finish(scope: _Scope, grads: list, params: list | None) -> dict:
  """The rows' new state after the loop: ``{i: (master, mu, nu, weight)}``.

  `weight` is the new master in device memory. The join's barrier is the
  stacked gradients, which exist only once the loop has ended.

  Raises:
    ValueError: If layers started their steps but `params` is None.
  """
  ids = sorted(scope.started)
  if not ids:
    return {}
  if params is None:
    raise ValueError(
      'overlap_scan: the layers re-seeded their steps from the parameters; '
      'call update with them: tx.update(grads, opt_state, params)'
    )
  barrier = steps.join_barrier([grads[i] for i in ids])
  done = {}
  for i in ids:
    # One join and one copy per leaf, as the buckets have: each new weight
    # reaches the device and is applied on its own, so no more than one
    # leaf's new weights wait in device memory at a time.
    joined, weight = grace_adam.join_rows(
      list(scope.stacks[i]), barrier, to_device=1
    )
    done[i] = (*joined, weight[0])
  return done
