"""Host steps of a scanned layer stack, started inside its backward loop.

A scanned stack's gradients exist, stacked, only once the backward loop
ends, so a host step started after the loop cannot overlap the backward
pass. Inside `overlap_scan`'s scope, ``weight_flow_scan(...,
params_path=...)`` passes each layer's weights through a `custom_vjp`
whose backward rule starts that layer's host step the moment the layer's
gradient exists: `grace_adam.adam_step_row` on row ``i`` of the stacked
fp32 state, written in place, with no result. `update`, called in the same
scope, leaves those leaves out of its buckets and joins their state after
the loop (`grace_adam.join_rows`, whose barrier is every gradient, the
stacked ones values only the loop computes), and copies each leaf's new
weights to the device.

Only leaves whose step the row step takes exactly are started in the loop:
the "stream" executor, fp32, bf16 or f16 parameters with fp32 master
weights and moments in host memory, no STV, ZeRO, 8-bit moments or double
buffering, and not in a device bucket or on optax's path; a rolled loop
(`unroll=1`) of two layers or more, whose stack leaves are the parameters'
own dtype; one device. The stacks' masters are re-seeded from their
parameters before the loop, as the buckets re-seed theirs, and only where
the state's digest says the parameters changed (`scan_hooks._reseeded`).
A 16-bit leaf's new weights are its new master rounded to nearest even,
the bits the buckets write: on a GPU, for a stack in device memory, the
row steps write them, a row at a time, into a 16-bit copy of the stack in
pinned host memory, which crosses to the device after the join as 16
bits (`scan_scope.host_weights`); otherwise (the CPU, weight flow's host
stacks) the fp32 master is rounded on the device after the join. Everything
else keeps its start after the loop, and with any other transformation
(optax's, or ours inside a wrapper such as `optax.chain` or
`optax.MultiSteps`) the scope does nothing.

The rows step with the gradient each stack leaf leaves its loop with,
from masters re-seeded from the parameters the scope was opened with. So
`update` must get exactly that gradient (the very value, or
`fetch_stacked`'s copy of it): a leaf also used outside its scan, a stack
transformed before it, a gradient scaled, clipped or summed after it, or
one from an inner `jit`, is refused at trace time (`check_gradients`),
before anything runs.

With ``consume_gradients=True`` (or ``JAX_SUPEROFFLOAD_SCAN_ROWS=held``
in the environment, read at trace time, which turns it on in every scope)
a stationary, fully rematerialized stack without `xs` instead gets a
backward loop of the library's own (`row_backward`): its row steps read
their rows of the stacked gradient, with a row cursor each in host
memory, and write the new weights over them, which the join hands on
(`scan_hooks.rows`). On a GPU the compute stream then waits for no copy
before the join, and the new weights cross during the backward pass.

At the scope's opening, the state of those leaves passes through the join
once: the row steps then write buffers of the step's own (a state the
caller did not donate is copied there first, as the bucket steps' aliased
results are), and the buckets of `update` read the same buffers. The host
copies of the 16-bit stacks, made then too, are such buffers already; they
meet the state at the join after the loop.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import optax

from jax_superoffload._src.core import layer_hooks
from jax_superoffload._src.host import grace_adam
from jax_superoffload._src.host import steps
from jax_superoffload._src.optim import scan_hooks
from jax_superoffload._src.optim import scan_scope
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.parallel import following


@contextlib.contextmanager
def overlap_scan(
  tx: optax.GradientTransformation,
  opt_state: Any,
  params: Any,
  *,
  consume_gradients: bool = False,
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
  (anything else is refused when `tx.update` is traced), where the scope
  was opened, not in a branch of `lax.cond` (to skip a step, select on
  its results).

  With `consume_gradients`, the host steps also write each layer's new
  weights over its gradient as soon as the step is done, so the new
  weights reach the device during the backward pass instead of after it
  (on a GPU, the fastest form; docs/gpu.md). The stacked gradients are
  then the optimizer's alone: `tx.update` takes them as they are, and
  anything else that reads them (a norm to log, the step's output) is
  refused when the step is compiled, naming the leaf. It applies to
  stacks run in device memory, fully rematerialized (``remat=True``, no
  `remat_policy`), without `xs`, inside `jax.jit`; others keep the
  layer-by-layer form, and their gradients stay readable.

  Args:
    tx: The transformation `superoffload.adam` / `adamw` returned. Any
      other makes the scope do nothing.
    opt_state: The state `tx.update` will be given (the same arrays).
    params: The parameters `tx.update` will be given, whose paths
      `params_path` names.
    consume_gradients: Let the host steps write the new weights over the
      stacked gradients, which only `tx.update` may then take.

  Raises:
    RuntimeError: On leaving the scope, if layers started their steps but
      `tx.update` was not called inside it.
  """
  opts = getattr(tx.update, scan_scope.OPTIONS_ATTRIBUTE, None)
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
  if active and not scan_scope.one_device((ours[0].master, params)):
    active = False  # A row step has no result to carry a sharding.
  scope = None
  if active:
    scope = scan_scope.Scope(opts, ours[0], params, consume_gradients)
  token = scan_scope.CURRENT.set(scope)
  try:
    hooks = None
    if scope is not None:
      hooks = layer_hooks.Hooks(
        scan_hooks.acquire,
        scan_hooks.hook,
        functools.partial(scan_hooks.note_moved, scope),
        scan_hooks.rows,
      )
    with layer_hooks.hooked(hooks):
      yield
  finally:
    scan_scope.CURRENT.reset(token)
  if scope is not None and scope.started and not scope.claimed:
    raise RuntimeError(
      'overlap_scan: layers started their host steps in the backward pass, '
      'but tx.update was not called inside the scope; call it there, with '
      'the gradients and the state the scope was opened with, on the '
      'transformation the scope was opened with'
    )


def check_gradients(scope: scan_scope.Scope, updates: Any) -> None:
  """Raises unless `update` got the gradients the started stacks made.

  The rows stepped with the gradient each stack leaf left its scan with;
  a gradient that is anything else (the leaf also used outside the scan,
  a loss scale, clipping, a sum over micro-batches, a transformed stack)
  would be stepped twice over, or wrongly. So it must be that very value.

  Raises:
    ValueError: Naming the first leaf whose gradient is another value.
  """
  i = _first_other(
    scope, updates, lambda i: [scope.cotangents.get(i), *scope.moves.get(i, ())]
  )
  if i is not None:
    raise ValueError(
      'overlap_scan: the gradient update got for parameter '
      f'{scope.plan.lay.paths[i]} is not the one its stack left the '
      'backward loop with (the leaf used outside the scan too, the '
      'stack transformed before it, or the gradient changed after it: '
      'scaled, clipped, summed); its layers have stepped with the '
      "loop's. Run the step without overlap_scan"
    )


def _first_other(scope: scan_scope.Scope, tree: Any, noted) -> int | None:
  """The first started leaf of `tree` that is none of `noted(i)`, if any.

  By identity: the rows used those very values (or their copies in
  another memory), and only the same value steps the same numbers.
  """
  leaves = jax.tree.leaves(tree)
  for i in sorted(scope.started):
    if i >= len(leaves) or not any(leaves[i] is x for x in noted(i)):
      return i
  return None


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


def claim(
  opts, state: Any, updates: Any, params: Any = None
) -> scan_scope.Scope | None:
  """The open scope `update(opts, updates, state)` finishes, if any.

  Raises:
    ValueError: If layers started their steps but `state` is not the one
      the scope was opened with, `update` is called twice in it, by a
      transformation with other options, or `updates`, the count or
      `params` are not those the rows took (`check_gradients`,
      `_check_inputs`).
  """
  scope = scan_scope.CURRENT.get()
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
  _check_trace(scope)
  check_gradients(scope, updates)
  if scope.started:
    _check_inputs(scope, state, params)
  return scope


def _check_trace(scope: scan_scope.Scope) -> None:
  """Raises if `update` is traced elsewhere than the scope was opened.

  The rows start in the backward loop whatever happens after it, and only
  `update`'s join waits for them (and, on a GPU, for their copies back):
  in a branch of `lax.cond` (a step skipped when it is not finite) or a
  loop, that join may not run while the rows still write.

  Raises:
    ValueError: If layers started their steps and the trace differs.
  """
  if scope.started and scan_scope.trace_state() != scope.trace:
    raise ValueError(
      'overlap_scan: tx.update was traced inside control flow (a branch '
      'of lax.cond or lax.switch, a loop) of the step, while the layers '
      'started their host steps unconditionally in the backward loop; call '
      'tx.update where the scope was opened (to skip a step, select on '
      'its results), or run the step without overlap_scan'
    )


def _check_inputs(scope: scan_scope.Scope, state: Any, params: Any) -> None:
  """Raises unless `update` got the count and parameters the rows used.

  The rows stepped at the scope's count and re-seeded from the scope's
  parameters: a count moved, or parameters changed after the gradient (a
  projection, a constraint), would step other numbers than update's.

  Raises:
    ValueError: Naming the count, or the first parameter that is another
      value.
  """
  if state.count is not scope.count:
    raise ValueError(
      'overlap_scan: update got a state whose count is not the one the '
      'scope was opened with; the layers have stepped at that count. Run '
      'the step without overlap_scan, or change the state before the scope'
    )
  if params is None:
    return  # `finish` says what is missing.
  i = _first_other(
    scope, params, lambda i: [scope.params[i], *scope.param_moves.get(i, ())]
  )
  if i is not None:
    raise ValueError(
      'overlap_scan: update got parameter '
      f'{scope.plan.lay.paths[i]} other than the one the scope was '
      'opened with (changed after the gradient: a projection, a '
      "constraint); its layers have re-seeded from the scope's. Change "
      'the parameters before the scope, or run the step without it'
    )


def with_stacks(
  scope: scan_scope.Scope, state: dict[str, list]
) -> dict[str, list]:
  """`update`'s state runs with the scope's joined stacks in place."""
  new = {n: list(xs) for n, xs in state.items()}
  for i, stack in scope.stacks.items():
    for r, n in enumerate(('master', 'mu', 'nu')):
      new[n][i] = stack[r]
  return new


def for_ordering(scope: scan_scope.Scope | None, grads: list) -> list:
  """`grads` to order a call after (a join's barrier), never to read.

  A gradient the rows consumed has no value (`scan_hooks.rows`): the
  buffer its loop left, which its rows wrote, stands in for it.
  """
  if scope is None:
    return list(grads)
  return [scope.written.get(i, g) for i, g in enumerate(grads)]


def finish(scope: scan_scope.Scope, grads: list, params: list | None) -> dict:
  """The rows' new state after the loop: ``{i: (master, mu, nu, weight)}``.

  `weight` is in device memory: the 16-bit weights the rows wrote on the
  host where the leaf has them (`scan_scope.host_weights`), else the new
  master. The join's barrier is every gradient of the step: the stacked
  ones exist only once the loop has ended, and with the others in it XLA
  makes those before the joins, not after, where their dots' operands
  (the output layer's activations) would wait through the new weights'
  copies to the device (weight flow, 1B on an H200: 0.10 GB more at the
  peak).

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
  barrier = steps.join_barrier(for_ordering(scope, grads))
  done = {}
  for i in ids:
    # One join and one copy per leaf, as the buckets have: each new weight
    # reaches the device and is applied on its own, so no more than one
    # leaf's new weights wait in device memory at a time. The parameters
    # stay alive until then: the re-seed's worker may read them.
    # The host weights, where the leaf has them, first: they are copied.
    # A consumed leaf's rows read its stacked gradient, their scalars and
    # cursors until the join, and write its new weights over the gradient.
    keep = [scope.params[i]]
    stack = scope.stacks[i]
    if i in scope.written:
      keep += [scope.written[i], *scope.held_operands]
      # Its host weights, if it has them, went unused.
      joined, _ = grace_adam.join_rows(list(stack[:3]), barrier, keep=keep)
      (weight,) = grace_adam.written_rows([scope.written[i]], joined[0])
      done[i] = (*joined, weight)
      continue
    joined, weight = grace_adam.join_rows(
      [*stack[3:], *stack[:3]], barrier, to_device=1, keep=keep
    )
    done[i] = (*joined[len(stack) - 3 :], weight[0])
  return done
