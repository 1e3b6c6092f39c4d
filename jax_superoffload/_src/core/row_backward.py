"""A layer scan whose backward loop hands each row's gradient to a hook.

JAX's transpose of `jax.lax.scan` builds the stacked gradient of the
layers' weights inside its backward loop, where nothing outside can reach
it: a hook inside a layer sees only that layer's gradient, a temporary
that XLA reuses in the next iteration. `scan` is the same scan with a
backward loop of its own (a `custom_vjp`): row ``i``'s weight gradient is
written into the stacked gradient, then ``on_row(aux, grads, i)`` gets the
stack, and the stack it returns is carried on. A hook that reads row
``i`` later (a host step's worker) reads the buffer the loop keeps, alive
after the loop as the gradient.

The backward recomputes each layer's forward from its input carry, as a
fully rematerialized scan does (`jax.checkpoint` with no policy), so it
runs the same work. `applies` says which scans it takes.

A hook may also consume a leaf's stacked gradient: write something else
(the new weights) over each row once it has read it. Such a leaf has a
`sink`, a differentiable alias of the stack whose cotangent is the buffer
the loop leaves (the sink's owner takes it there), and the leaf's own
gradient is `consumed_gradient`: a value nothing may read (tracing it into
a computation raises), so that no reader of the gradient ever gets the
weights written over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

_consumed_p = jex_core.Primitive('jax_superoffload_consumed_gradient')


def _consumed_abstract(*, shape, dtype, why):
  del why
  return jax.core.ShapedArray(shape, dtype)


def _consumed_read(*_, why, **__):
  raise ValueError(why)


_consumed_p.def_abstract_eval(_consumed_abstract)
_consumed_p.def_impl(lambda **kw: _consumed_read(**kw))
mlir.register_lowering(_consumed_p, _consumed_read)


def consumed_gradient(like: Any, why: str) -> jax.Array:
  """A stand-in for a gradient that was consumed, shaped like `like`.

  It has no value: JAX drops it where nothing reads it, and compiling (or
  running) anything that reads it raises ValueError(`why`).
  """
  return _consumed_p.bind(
    shape=tuple(jnp.shape(like)), dtype=jnp.result_type(like), why=why
  )


def sink(x: jax.Array, take: Callable[[jax.Array], None]) -> jax.Array:
  """`x`, as a differentiable alias whose cotangent goes to `take`.

  `scan`'s backward gives a consumed leaf's loop buffer as that
  cotangent; `take` receives it (a value of the outer trace) and `x`
  gets no gradient from the alias.
  """

  @jax.custom_vjp
  def alias(x):
    return x

  def forward(x):
    return x, None

  def backward(_, ct):
    take(ct)
    return (None,)

  alias.defvjp(forward, backward)
  return alias(x)


def _inexact(tree: Any) -> bool:
  return all(
    jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    for x in jax.tree.leaves(tree)
  )


def _differentiated(x: Any) -> bool:
  """Whether `x` is a tracer of differentiation (JVP or linearization)."""
  while isinstance(x, jax.core.Tracer):
    if hasattr(x, 'tangent') or type(x).__name__ == 'LinearizeTracer':
      return True
    x = getattr(x, 'primal', getattr(x, 'val', None))
  return False


def applies(
  layer: Callable[[Any, Any], tuple[Any, Any]], carry: Any, stacked: Any
) -> tuple[Callable, list] | None:
  """`layer` with its closed-over arrays as arguments, if `scan` takes it.

  `scan` takes a layer whose carry, weights and per-layer outputs are all
  floating point (their cotangents are arrays), and that closes over no
  value being differentiated (its gradient would be another output of the
  backward loop). Returns ``(fn, consts)`` with ``fn(p, c, *consts)``
  `layer`, or None.
  """
  if not _inexact((carry, stacked)) or not jax.tree.leaves(stacked):
    return None
  row = jax.tree.map(lambda x: x[0], stacked)
  try:
    fn, consts = jax.closure_convert(layer, row, carry)
    _, ys = jax.eval_shape(fn, row, carry, *consts)
  except Exception:  # A layer closure_convert cannot trace: not ours.
    return None
  if not _inexact(ys) or any(_differentiated(c) for c in consts):
    return None
  return fn, list(consts)


def scan(
  layer: Callable[..., tuple[Any, Any]],
  consts: list,
  carry: Any,
  stacked: Any,
  on_row: Callable[[Any, Any, jax.Array], Any],
  aux: Any,
  sinks: Any = None,
) -> tuple[Any, Any]:
  """``jax.lax.scan(lambda c, p: layer(p, c, *consts), carry, stacked)``.

  Its backward loop calls ``on_row(aux, grads, i)`` once row ``i`` of
  `stacked`'s gradient is in `grads` (rows ``i`` to L-1 are), and carries
  on the stack it returns. `aux` (arrays) reaches `on_row` as an operand:
  a rule may not close over the jit's tracers. `layer` and `consts` as
  `applies` returned them. `sinks`: None, or an entry per leaf of
  `stacked`: None, or, for a leaf whose gradient `on_row` consumes,
  ``(alias, why)``: its `sink` alias gets the buffer the loop leaves as
  its cotangent, and the leaf's own cotangent is a `consumed_gradient`
  that raises ``ValueError(why)`` where read.
  """
  leaves = jax.tree.leaves(stacked)
  sinks = list(sinks) if sinks is not None else [None] * len(leaves)
  aliases = [s[0] if s is not None else None for s in sinks]

  @jax.custom_vjp
  def run(stacked, carry, aux, consts, aliases):
    del aux, aliases
    return jax.lax.scan(lambda c, p: layer(p, c, *consts), carry, stacked)

  def forward(stacked, carry, aux, consts, aliases):
    del aliases

    def step(c, p):
      out, y = layer(p, c, *consts)
      return out, (y, c)

    last, (ys, carries) = jax.lax.scan(step, carry, stacked)
    return (last, ys), (stacked, carries, aux, consts)

  def backward(res, cts):
    stacked, carries, aux, consts = res
    ct_last, ct_ys = cts
    weights_ct, carry_ct = _backward_loop(
      layer, consts, stacked, carries, ct_last, ct_ys, on_row, aux
    )
    values, treedef = jax.tree.flatten(weights_ct)
    to_sinks = [None] * len(values)
    for j, s in enumerate(sinks):
      if s is not None:
        to_sinks[j] = values[j]
        values[j] = consumed_gradient(values[j], s[1])
    weights_ct = jax.tree.unflatten(treedef, values)
    return weights_ct, carry_ct, None, [None] * len(consts), to_sinks

  run.defvjp(forward, backward)
  return run(stacked, carry, aux, consts, aliases)


def _backward_loop(
  layer, consts, stacked, carries, ct_last, ct_ys, on_row, aux
):
  """The stacked weights' gradient and the first carry's, row L-1 first."""
  rows = jnp.shape(jax.tree.leaves(stacked)[0])[0]

  def at(tree, i):
    return jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree
    )

  def step(state, i):
    ct, grads = state
    _, pull = jax.vjp(
      lambda p, c: layer(p, c, *consts), at(stacked, i), at(carries, i)
    )
    row_grads, ct_carry = pull((ct, at(ct_ys, i)))
    grads = jax.tree.map(
      lambda g, r: jax.lax.dynamic_update_index_in_dim(g, r, i, 0),
      grads,
      row_grads,
    )
    return (ct_carry, on_row(aux, grads, i)), None

  zeros = jax.tree.map(jnp.zeros_like, stacked)
  counters = jnp.arange(rows, dtype=jnp.int32)
  (ct_first, grads), _ = jax.lax.scan(
    step, (ct_last, zeros), counters, reverse=True
  )
  return grads, ct_first
