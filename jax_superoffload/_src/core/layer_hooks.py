"""The hooks a scanned layer stack calls, before its scan and per layer.

`weight_flow_scan` (parallel/) calls `stack_starts` before its scan and
`layer_weights` on every layer's weights; `overlap_scan` (optim/) sets
what they do while its scope is open. They live here, below both, so
that neither package imports the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax


class Hooks(NamedTuple):
  """What an open scope does to layer stacks.

  `stack(stacked_params, params_path, unroll, inputs) -> stacked_params`,
  before a stack's scan of `inputs` (its carry and xs); and
  `layer(layer_params, row, params_path) -> layer_params`, on each layer's
  weights inside it.
  """

  stack: Callable[[Any, Any, Any, Any], Any]
  layer: Callable[[Any, Any, Any], Any]
  # moved(x, y): `y` is `x` moved to another memory (the same values).
  moved: Callable[[Any, Any], None]
  # rows(stacked_params, params_path) -> (on_row, aux, sinks) or None: the
  # hook a stack's own backward loop calls on its stacked gradient
  # (`row_backward.scan`), instead of `layer` on each layer's.
  rows: Callable[[Any, Any], tuple[Callable, Any, Any] | None] | None = None


_HOOKS: contextvars.ContextVar[Hooks | None] = contextvars.ContextVar(
  'jax_superoffload_layer_hooks', default=None
)


def stack_starts(
  stacked_params: Any, params_path: Any, unroll: Any, inputs: Any
) -> Any:
  """`stacked_params`, as the open scope's hook passes them to the scan.

  `params_path` is where the stack sits in the optimizer's parameters
  (None: the caller did not say, and nothing is hooked); `unroll` the
  scan's, and `inputs` the rest it scans (carry and xs).
  """
  hooks = _HOOKS.get()
  if hooks is None or params_path is None:
    return stacked_params
  return hooks.stack(stacked_params, params_path, unroll, inputs)


def layer_weights(layer_params: Any, row: Any, params_path: Any) -> Any:
  """`layer_params` through the open scope's hook; as they are without one.

  `row` is the layer's index in its stack (the scan's counter).
  """
  hooks = _HOOKS.get()
  if hooks is None or params_path is None:
    return layer_params
  return hooks.layer(layer_params, row, params_path)


def row_hook(stacked_params: Any, params_path: Any) -> tuple | None:
  """``(on_row, aux, sinks)`` for a stack whose backward loop is ours.

  Asked after `stack_starts`, for a stack that `row_backward.scan` can
  run (None: no answer); with an answer, the stack's layers are not
  hooked one by one.
  """
  hooks = _HOOKS.get()
  if hooks is None or params_path is None or hooks.rows is None:
    return None
  return hooks.rows(stacked_params, params_path)


def moved(tree: Any, new: Any) -> Any:
  """`new`, told to the open scope as `tree`'s leaves moved; returns it."""
  hooks = _HOOKS.get()
  if hooks is not None:
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(new), strict=True):
      hooks.moved(x, y)
  return new


@contextlib.contextmanager
def hooked(hooks: Hooks | None) -> Iterator[None]:
  """`hooks` are the layer stacks' inside the block (None: none)."""
  token = _HOOKS.set(hooks)
  try:
    yield
  finally:
    _HOOKS.reset(token)
