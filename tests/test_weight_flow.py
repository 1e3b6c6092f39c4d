"""Weight-flow layer stacks: weight-stationary numbers, per-layer transfers."""

# Tensor names carry their shapes (`x_BxD`), NanoDO style.
# ruff: noqa: N803, N806

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer import config
from experiments.trainer import model
from experiments.trainer import train
from jax_superoffload._src.core.host_memory import memory_kind
from jax_superoffload._src.parallel import weight_flow

HOST = 'pinned_host'
# Distinct sizes, so a per-layer shape never equals a stacked one.
LAYERS, WIDTH, HIDDEN, BATCH = 3, 8, 16, 4


def mlp_stack(seed=0):
  k_up, k_down, k_bias = jax.random.split(jax.random.key(seed), 3)
  return {
    'up': 0.3 * jax.random.normal(k_up, (LAYERS, WIDTH, HIDDEN)),
    'down': 0.3 * jax.random.normal(k_down, (LAYERS, HIDDEN, WIDTH)),
    'bias': 0.1 * jax.random.normal(k_bias, (LAYERS, WIDTH)),
  }


def mlp_body(layer, x_BxD, scale):
  h_BxF = jnp.tanh(x_BxD @ layer['up'])
  x_BxD = x_BxD + scale * (h_BxF @ layer['down']) + layer['bias']
  return x_BxD, jnp.mean(x_BxD**2)  # A per-layer output (ys).


def mlp_loss(stack, x_BxD, policy):
  scales_L = jnp.linspace(0.5, 1.0, LAYERS)  # Per-layer xs, on the device.
  x_BxD, sq_L = weight_flow.weight_flow_scan(
    mlp_body, x_BxD, stack, scales_L, policy=policy
  )
  return jnp.mean(x_BxD**2) + 0.1 * jnp.sum(sq_L)


def kinds(tree):
  return {memory_kind(x) for x in jax.tree.leaves(tree)}


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_grad = jax.jit(jax.value_and_grad(mlp_loss), static_argnums=2)


def test_scan_body_fetches_only_its_layer():
  # Backend-independent: the scan reads the host-resident stack and the
  # body device_puts the [WIDTH, HIDDEN] slice, never the stack.
  stack = weight_flow.offload_stacked(mlp_stack())
  x_BxD = jnp.ones((BATCH, WIDTH))
  jaxpr = jax.make_jaxpr(jax.grad(mlp_loss), static_argnums=2)(
    stack, x_BxD, 'flow'
  )
  scanned = [
    (v.aval.shape, v.aval.memory_space)
    for eqn in _all_eqns(jaxpr.jaxpr)
    if eqn.primitive.name == 'scan'
    for v in eqn.invars
  ]
  stacked = ((LAYERS, WIDTH, HIDDEN), jax.memory.Space.Host)
  assert stacked in scanned
  puts = [
    eqn for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == 'device_put'
  ]
  to_device = [
    (v.aval.shape, v.aval.memory_space)
    for eqn in puts
    for v in eqn.invars
    if jax.memory.Space.Device in eqn.params['devices']
  ]
  assert ((WIDTH, HIDDEN), jax.memory.Space.Host) in to_device
  assert all(len(shape) < 3 for shape, _ in to_device)


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _all_eqns(sub)


def test_gpu_lowering_transfers_one_layer_per_iteration():
  # On CPU the device_put of a slice lowers to nothing (host and device
  # memory are the same RAM); the GPU lowering shows what XLA's host
  # offloader receives: an annotate_device_placement on each per-layer slice
  # inside the loop, and one on each per-layer gradient back to the host.
  stack = weight_flow.offload_stacked(mlp_stack())
  x_BxD = jnp.ones((BATCH, WIDTH))
  traced = _grad.trace(stack, x_BxD, 'flow')
  try:
    text = traced.lower(lowering_platforms=('cuda',)).as_text()
  except Exception as e:  # A jax without cross-platform lowering.
    pytest.skip(f'cannot lower for cuda here: {e}')
  header = text.split('\n', 3)[2]
  assert header.count(f'mhlo.memory_kind = "{HOST}"') >= 6  # 3 in, 3 out.
  placements = re.findall(
    r'annotate_device_placement\(.*?_xla_buffer_placement = "(\w+)"'
    r'.*?: \(tensor<([\dx]+)xf32>\)',
    text,
  )
  to_device = [shape for where, shape in placements if where == 'device']
  to_host = sorted(shape for where, shape in placements if where == HOST)
  per_layer = {f'{WIDTH}x{HIDDEN}', f'{HIDDEN}x{WIDTH}', f'{WIDTH}'}
  # Forward fetches each layer's leaves, the rematerialized backward fetches
  # them again: a count independent of the number of layers.
  assert set(to_device) == per_layer
  assert len(to_device) <= 2 * len(per_layer)
  assert to_host == sorted(per_layer)


def test_placement_and_option_errors():
  stack = mlp_stack()
  x_BxD = jnp.ones((BATCH, WIDTH))
  body = lambda layer, x: mlp_body(layer, x, 1.0)  # noqa: E731
  with pytest.raises(ValueError, match=r"\['bias'\].*float32\[3, 8\].*dev"):
    weight_flow.weight_flow_scan(body, x_BxD, stack, policy='flow')
  offloaded = weight_flow.offload_stacked(stack)
  with pytest.raises(ValueError, match=r'in host memory.*policy=.flow'):
    weight_flow.weight_flow_scan(body, x_BxD, offloaded, policy='stationary')
  with pytest.raises(ValueError, match='remat=True'):
    weight_flow.weight_flow_scan(body, x_BxD, offloaded, remat=False)
  with pytest.raises(ValueError, match='policy must be one of'):
    weight_flow.weight_flow_scan(body, x_BxD, stack, policy='auto')


def test_flow_trains_bit_for_bit_like_stationary():
  # Three superoffload.adamw steps on the MLP stack under both policies.
  tx = superoffload.adamw(1e-2, weight_decay=0.1)
  x_BxD = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))

  @jax.jit
  def stationary_step(stack, opt_state):
    loss, grads = jax.value_and_grad(mlp_loss)(stack, x_BxD, 'stationary')
    updates, opt_state = tx.update(grads, opt_state, stack)
    return loss, grads, optax.apply_updates(stack, updates), opt_state

  @jax.jit
  def flow_step(stack, opt_state):
    loss, grads = jax.value_and_grad(mlp_loss)(stack, x_BxD, 'flow')
    stack, opt_state = weight_flow.update_offloaded(tx, grads, opt_state, stack)
    return loss, grads, stack, opt_state

  stack_s = mlp_stack()
  state_s = tx.init(stack_s)
  stack_f = weight_flow.offload_stacked(mlp_stack())
  state_f = tx.init(mlp_stack())  # Optimizers initialize from the device.
  assert kinds(stack_f) == {HOST}
  for _ in range(3):
    loss_s, grads_s, stack_s, state_s = stationary_step(stack_s, state_s)
    loss_f, grads_f, stack_f, state_f = flow_step(stack_f, state_f)
    assert float(loss_s) == float(loss_f)
    assert_trees_equal(grads_s, grads_f)
    # JAX transposes the per-layer device_put into a device-to-host copy:
    # gradients of host-resident weights come out in host memory.
    assert kinds(grads_f) == {HOST}
    assert kinds(grads_s) == {'device'}
    assert kinds(stack_f) == {HOST}
  assert_trees_equal(stack_s, stack_f)
  assert kinds(state_f.master) == {HOST}
  assert flow_step._cache_size() == 1


def test_match_placement_follows_a_snapshot():
  tree = {'a': jnp.ones(3), 'b': weight_flow.offload_stacked(jnp.ones(2))}
  spaces = weight_flow.memory_spaces(tree)
  moved = jax.jit(
    lambda t: weight_flow.match_placement(weight_flow.fetch_stacked(t), spaces)
  )(tree)
  assert memory_kind(moved['a']) == 'device'
  assert memory_kind(moved['b']) == HOST


def test_decoder_with_weights_policy_flow_trains():
  # The tiny decoder with its blocks as a scanned stack in host memory: two
  # superoffload.adamw steps through `model.apply_gradients`. (Equality with
  # weight-stationary is checked on the MLP above; a second decoder compile
  # would double this test's time.)
  cfg = config.get_config(
    'tiny', num_layers=2, seq_len=16, scan_layers=True, weights_policy='flow'
  )
  tokens_BxL = np.random.default_rng(0).integers(0, 256, (2, 17), np.int32)
  inputs_BxL, targets_BxL = tokens_BxL[:, :-1], tokens_BxL[:, 1:]

  @nnx.jit
  def train_step(net, optimizer):
    grad_fn = nnx.value_and_grad(model.loss_fn)
    loss, grads = grad_fn(net, inputs_BxL, targets_BxL)
    model.apply_gradients(net, optimizer, grads)
    return loss

  net = model.init_model(cfg)
  tx = superoffload.adamw(1e-2, weight_decay=0.0)
  optimizer = nnx.Optimizer(net, tx, wrt=nnx.Param)  # From device weights.
  model.offload_weights(net)
  train.commit_placement(net, optimizer)  # One compile for both steps.
  assert kinds(nnx.state(net.blocks)) == {HOST}
  before = jax.tree.map(np.asarray, nnx.state(net.blocks))
  losses = [float(train_step(net, optimizer)) for _ in range(2)]
  assert kinds(nnx.state(net.blocks)) == {HOST}
  assert kinds(nnx.state(net.token_embed)) == {'device'}
  assert np.isfinite(losses).all() and losses[1] < losses[0]
  after = jax.tree.map(np.asarray, nnx.state(net.blocks))
  assert not np.array_equal(
    before['mlp']['up']['kernel'][...], after['mlp']['up']['kernel'][...]
  )


def test_flow_needs_scanned_blocks():
  cfg = config.get_config('tiny', weights_policy='flow')
  with pytest.raises(ValueError, match='scan_layers'):
    nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
