"""Adaptive weight offloading: weight-stationary or weight-flow layer stacks.

Weight-stationary keeps the (low-precision) weights in device memory; only
the optimizer state lives on the host. Weight-flow keeps the weights of a
scanned layer stack (leading layer axis L, as built by `nnx.vmap` or any
stacked pytree) in pinned host memory and streams them to the device one
layer at a time inside the scan, for the forward pass and again, through
rematerialization, for the backward pass.

How JAX 0.10 handles it:

- The scan body slices layer ``i`` out of the host-resident stack and
  `jax.device_put`s that slice to ``Space.Device``. On GPU and TPU this
  lowers to an ``annotate_device_placement`` custom call on the per-layer
  slice, which XLA's host offloader turns into a host-to-device copy inside
  the loop. On the CPU backend the placement is a no-op in the lowered
  module (host and device memory are the same RAM there); only the entry
  parameters and results carry the ``pinned_host`` memory kind.
- The transpose of that `device_put` is a device-to-host copy of the layer's
  gradient, also inside the (backward) loop: the gradient of a host-resident
  stack comes out in host memory, one layer at a time, and the full stacked
  gradient never exists on the device. That is where SuperOffload wants
  gradients anyway; `fetch_stacked` brings them back for a device optimizer.
- Without rematerialization the backward pass would keep every layer's
  device copy as a residual (all L layers on the device), so weight-flow
  always wraps the body in `jax.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layer_hooks
from jax_superoffload._src.core import row_backward

WEIGHT_POLICIES = ('stationary', 'flow')


def _memory_space(x: Any) -> jax.memory.Space:
  """The memory space of an array, a tracer, or a `jax.memory.Space`."""
  if isinstance(x, jax.memory.Space):
    return x
  space = getattr(jax.typeof(x), 'memory_space', None)
  if space is not None:
    return space
  if host_memory.memory_kind(x) == host_memory.HOST_MEMORY_KIND:
    return jax.memory.Space.Host
  return jax.memory.Space.Device


def _is_host(x: Any) -> bool:
  return _memory_space(x) == jax.memory.Space.Host


def memory_spaces(tree: Any) -> Any:
  """The `jax.memory.Space` of every array of `tree`, as a tree.

  A snapshot to restore placement from with `match_placement`, for trees
  whose leaves change in place (the Variables of an NNX `State`).

  Args:
    tree: A pytree of arrays or tracers.

  Returns:
    A tree of the same structure with `jax.memory.Space` leaves.
  """
  return jax.tree.map(_memory_space, tree)


def offload_stacked(tree: Any) -> Any:
  """Places every array of `tree` in pinned host memory.

  Works outside `jit` (a transfer) and inside it (a placement of the
  result). Use it on the stacked weights of a layer stack before running it
  with ``weight_flow_scan(..., policy='flow')``.

  Args:
    tree: A pytree of arrays, e.g. a stacked parameter tree or an NNX
      `State`.

  Returns:
    The same tree with every leaf in host memory (unchanged where the
    backend has no host memory space).
  """
  return jax.tree.map(host_memory.to_host, tree)


def fetch_stacked(tree: Any) -> Any:
  """Places every array of `tree` in device memory (undoes `offload_stacked`).

  Args:
    tree: A pytree of arrays, e.g. gradients of host-resident weights.

  Returns:
    The same tree with every leaf in device memory.
  """
  # A started stack's gradient moved so is still the one its scan made.
  return layer_hooks.moved(tree, jax.tree.map(host_memory.to_device, tree))


def match_placement(tree: Any, like: Any) -> Any:
  """Puts each leaf of `tree` in the memory space of the same leaf of `like`.

  Typical use: restore host residence after an update computed on the
  device, ``params = match_placement(new_params, params)``.

  Args:
    tree: A pytree of arrays.
    like: A pytree of the same structure whose leaves are arrays, tracers or
      `jax.memory.Space` values (see `memory_spaces`).

  Returns:
    `tree` with host leaves where `like` has them, device leaves elsewhere.
  """

  def place(x: Any, ref: Any) -> Any:
    if _is_host(ref):
      return host_memory.to_host(x)
    return host_memory.to_device(x)

  return jax.tree.map(place, tree, like)


def update_offloaded(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  opt_state: optax.OptState,
  params: optax.Params,
) -> tuple[optax.Params, optax.OptState]:
  """One optimizer step on parameters that may live in host memory.

  Optax transformations (and `superoffload.adamw`, whose state already
  lives on the host) compute with device arrays and reject operands of mixed
  memory spaces. This brings the gradients and parameters to the device,
  runs ``tx.update`` and `optax.apply_updates` there, and puts every new
  parameter back where the old one lived. Under `jit` XLA can schedule the
  transfers leaf by leaf, but a stacked leaf is on the device whole while
  it is updated.

  Args:
    tx: The optimizer.
    grads: Gradients, in any memory (weight-flow gradients are on the host).
    opt_state: ``tx``'s state.
    params: Parameters, some of them possibly in host memory.

  Returns:
    ``(new_params, new_opt_state)``; `new_params` has the placement of
    `params`.
  """
  device_params = fetch_stacked(params)
  updates, opt_state = tx.update(fetch_stacked(grads), opt_state, device_params)
  new_params = optax.apply_updates(device_params, updates)
  return match_placement(new_params, params), opt_state


def _check_placement(stacked_params: Any, policy: str) -> None:
  """Raises if a leaf is not where `policy` expects the weights to live."""
  if not host_memory.host_memory_available():
    return
  for path, leaf in jax.tree.leaves_with_path(stacked_params):
    on_host = _is_host(leaf)
    if on_host == (policy == 'flow'):
      continue
    aval = jax.typeof(leaf)
    expected, actual = ('device', 'host') if on_host else ('host', 'device')
    hint = (
      'place them with offload_stacked'
      if policy == 'flow'
      else "use policy='flow', or fetch_stacked"
    )
    raise ValueError(
      f'policy {policy!r} expects the stacked weights in {expected} memory, '
      f'but {jax.tree_util.keystr(path) or "<root>"} '
      f'({aval.dtype}{list(aval.shape)}) is in {actual} memory; {hint}'
    )


def weight_flow_scan(
  body_fn: Callable[..., tuple[Any, Any]],
  carry: Any,
  stacked_params: Any,
  xs: Any = None,
  *,
  policy: str = 'flow',
  remat: bool = True,
  remat_policy: Callable[..., bool] | None = None,
  unroll: int | bool = 1,
  params_path: Any = None,
) -> tuple[Any, Any]:
  """Runs a layer stack as a scan, streaming host-resident weights per layer.

  Equivalent to ``jax.lax.scan(lambda c, p: body_fn(p, c), carry,
  stacked_params)``, with the weights' placement chosen by `policy`:

  - ``'stationary'``: the stacked weights are in device memory and each step
    reads its slice there.
  - ``'flow'``: the stacked weights are in pinned host memory (see
    `offload_stacked`); each step copies only its own layer's slice to the
    device, so at most the current layer's weights (two, when XLA overlaps
    the next copy with compute) occupy device memory. The body is
    rematerialized, so the backward pass streams each layer again instead
    of keeping L device copies as residuals, and the weights' gradients come
    out in host memory, one layer at a time.

  Both policies run the same arithmetic: losses and gradients agree bit for
  bit (the transfers are exact copies).

  Example::

    def body(layer, x):
      return jnp.tanh(x @ layer['w'] + layer['b']), None

    stack = superoffload.offload_stacked({'w': w_LxDxD, 'b': b_LxD})
    x, _ = superoffload.weight_flow_scan(body, x, stack, policy='flow')

  Args:
    body_fn: ``body_fn(layer_params, carry) -> (carry, y)``, or
      ``body_fn(layer_params, carry, x) -> (carry, y)`` when `xs` is given.
      `layer_params` is `stacked_params` without the leading axis, in device
      memory under either policy.
    carry: The initial carry (activations), in device memory.
    stacked_params: A pytree whose leaves share a leading layer axis L.
    xs: Optional per-layer inputs with the same leading axis, kept where
      they are (e.g. per-layer RNG keys).
    policy: ``'stationary'`` or ``'flow'``.
    remat: Wrap the body in `jax.checkpoint`. Required for ``'flow'``.
    remat_policy: A `jax.checkpoint_policies` policy for the body, e.g.
      ``dots_with_no_batch_dims_saveable`` to keep activations; a policy
      that saves the fetched weights keeps all L layers on the device.
    unroll: Passed to `jax.lax.scan`; each unrolled layer adds its weights
      to the device-resident set.
    params_path: Where `stacked_params` sits in the parameters given to
      the optimizer: a key (``'blocks'``) or a sequence of keys (``('model',
      'blocks')``, or a JAX key path). Inside `overlap_scan`'s scope, the
      backward pass then starts each layer's optimizer step as soon as that
      layer's gradient exists; elsewhere it changes nothing.

  Returns:
    ``(carry, ys)`` as from `jax.lax.scan`: the final carry and the
    per-layer outputs stacked along a leading axis.

  Raises:
    ValueError: For an unknown policy, ``'flow'`` without `remat`, or a
      weight leaf in the other memory space than `policy` expects.
  """
  if policy not in WEIGHT_POLICIES:
    raise ValueError(f'policy must be one of {WEIGHT_POLICIES}, got {policy!r}')
  if policy == 'flow' and not remat:
    raise ValueError(
      "policy='flow' needs remat=True: without rematerialization the "
      "backward pass keeps every layer's device copy of its weights"
    )
  if remat_policy is not None and not remat:
    raise ValueError('remat_policy is only used with remat=True')
  _check_placement(stacked_params, policy)

  def plain(layer_params: Any, carry: Any, x: Any) -> tuple[Any, Any]:
    if xs is None:
      return body_fn(layer_params, carry)
    return body_fn(layer_params, carry, x)

  def layer_fn(layer_params: Any, carry: Any, x: Any) -> tuple[Any, Any]:
    x, row = x
    if row is not None:
      row = row.astype(jnp.int32)  # See `rows` below.
    if policy == 'flow':
      # Inside the checkpointed region, so backward fetches the layer again.
      layer_params = fetch_stacked(layer_params)
    # In device memory and inside the checkpoint, so its backward has the
    # layer's gradient as the pass makes it and the weights (re-seed).
    layer_params = layer_hooks.layer_weights(layer_params, row, params_path)
    return plain(layer_params, carry, x)

  if remat:
    # The scan already keeps forward and backward apart; no CSE barrier
    # needed (it would also sit between the slice and the device copy).
    layer_fn = jax.checkpoint(layer_fn, prevent_cse=False, policy=remat_policy)

  def step(carry: Any, inputs: tuple[Any, Any]) -> tuple[Any, Any]:
    layer_params, x = inputs
    return layer_fn(layer_params, carry, x)

  stacked_params = layer_hooks.stack_starts(
    stacked_params, params_path, unroll, (carry, xs)
  )
  held = None
  if policy == 'stationary' and remat and remat_policy is None and xs is None:
    held = _held_rows(plain, carry, stacked_params, params_path)
  if held is not None:
    return held
  rows = _row_counters(stacked_params, params_path)
  return jax.lax.scan(step, carry, (stacked_params, (xs, rows)), unroll=unroll)


def _held_rows(plain, carry, stacked_params, params_path):
  """The scan with its own backward loop, where the open scope asks for it.

  The scope's row steps then read the stacked gradient the loop keeps,
  not each layer's temporary (`row_backward`). Fully rematerialized, as
  the scan it replaces: its backward recomputes each layer from its input.
  """
  hook = layer_hooks.row_hook(stacked_params, params_path)
  if hook is None:
    return None

  def layer(p, c):
    return plain(p, c, None)

  converted = row_backward.applies(layer, carry, stacked_params)
  if converted is None:
    return None
  fn, consts = converted
  on_row, aux, sinks = hook
  return row_backward.scan(
    fn, consts, carry, stacked_params, on_row, aux, sinks
  )


def _row_counters(stacked_params: Any, params_path: Any) -> jax.Array | None:
  """Each layer's index, for the hooks of a stack that names its path.

  Unsigned, converted in the body: a slice of the counters that only
  copied them, XLA:GPU would run asynchronously, and its scheduler then
  reorders the backward around that copy (overlap_scan's row steps read
  the counter; 1B on an H200: 0.72 GB more device memory).
  """
  leaves = jax.tree.leaves(stacked_params)
  if params_path is None or not leaves:
    return None
  return jnp.arange(jnp.shape(leaves[0])[0], dtype=jnp.uint32)
