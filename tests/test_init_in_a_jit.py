"""`init` traced inside a trainer's jit, under every mesh a trainer uses.

Trainers (MaxText among them) make the whole train state in one jit, with
`out_shardings` from their own sharding rules, under `jax.set_mesh` or the
old `with mesh:`, with auto or explicit axes; the parameters are split
(FSDP, tensor parallel) or made inside that jit from a key. The state must
come out where and as the parameters are split, and `state_shardings`
must give a trainer the shardings that keep it in host memory. The judge
for the numbers is optax's adamw, stepped the same way (fp32: a few
roundings apart).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload

HOST = 'pinned_host'
F32_EPS = float(np.finfo(np.float32).eps)
SPECS = {'w': P('fsdp', 'tp'), 'b': P('tp'), 'k': P()}
SHAPES = {'w': (8, 16), 'b': (16,), 'k': (5,)}


def _mesh(axis_type):
  return jax.make_mesh((2, 4), ('fsdp', 'tp'), axis_types=(axis_type,) * 2)


def _params(mesh):
  rng = np.random.default_rng(0)
  return {
    k: jax.device_put(
      jnp.asarray(rng.standard_normal(SHAPES[k]), jnp.float32),
      NamedSharding(mesh, SPECS[k]),
    )
    for k in SPECS
  }


def _context(kind, mesh):
  if kind == 'set_mesh':
    return jax.set_mesh(mesh)
  if kind == 'use_mesh':
    use_mesh = getattr(jax.sharding, 'use_mesh', None)
    if use_mesh is None:
      pytest.skip(f'jax {jax.__version__} has no jax.sharding.use_mesh')
    return use_mesh(mesh)
  return mesh  # The old `with mesh:`.


def _assert_split_as_params(ours, mesh):
  """Every state array of ours split as its parameter, host memory."""
  assert isinstance(ours, superoffload.SuperOffloadState)
  for field in (ours.mu, ours.nu, ours.master):
    for name, x in field.items():
      assert x.sharding.memory_kind == HOST, name
      want = NamedSharding(mesh, SPECS[name], memory_kind=HOST)
      assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding)


@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize('context', ['old_with_mesh', 'set_mesh', 'use_mesh'])
@pytest.mark.filterwarnings('ignore:.*with mesh.*:DeprecationWarning')
def test_a_jitted_init_makes_the_state_split_as_the_parameters(
  context, axis_type
):
  # The old `with mesh:` failed here: init's own jit named one device.
  mesh = _mesh(axis_type)
  params = _params(mesh)
  tx = optax.chain(superoffload.adamw(1e-2))
  with _context(context, mesh):
    state = jax.jit(tx.init)(params)
  _assert_split_as_params(state[0], mesh)


@pytest.mark.parametrize('context', ['old_with_mesh', 'set_mesh'])
@pytest.mark.filterwarnings('ignore:.*with mesh.*:DeprecationWarning')
def test_params_made_inside_the_jit_give_a_state_split_as_they_are(context):
  # MaxText's way: params from a key, inside the jit that makes the state,
  # placed by that jit's out_shardings alone.
  mesh = _mesh(AxisType.Auto)
  tx = optax.chain(superoffload.adamw(1e-2))
  shardings = {k: NamedSharding(mesh, SPECS[k]) for k in SPECS}

  def make(key):
    keys = dict(zip(SHAPES, jax.random.split(key, len(SHAPES)), strict=True))
    p = {k: jax.random.normal(keys[k], SHAPES[k]) for k in SHAPES}
    return p, tx.init(p)

  with _context(context, mesh):
    made = jax.jit(make, out_shardings=(shardings, None))
    _, state = made(jax.random.key(0))
  _assert_split_as_params(state[0], mesh)


@pytest.mark.parametrize('executor', ['auto', 'stream'])
@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
def test_state_shardings_keep_a_trainers_state_on_the_host_per_shard(
  axis_type, executor
):
  # A trainer's own jits, their shardings from state_shardings: the state
  # is made and stepped in host memory, split as the parameters, and the
  # step runs each shard where it lives (no gather of the state).
  mesh = _mesh(axis_type)
  params = _params(mesh)
  param_shardings = {k: NamedSharding(mesh, SPECS[k]) for k in SPECS}
  ours = superoffload.adamw(
    1e-2, weight_decay=0.1, offload=superoffload.Offload(executor=executor)
  )
  # The stream executor's state keeps a digest of the weights: the layout
  # state_shardings gives must be the one the trainer's init makes.
  shardings = superoffload.state_shardings(ours, params)

  def loss(p):
    return sum(jnp.sum(jnp.sin(v) ** 2) for v in jax.tree.leaves(p))

  def run(tx, state_shardings):
    p = params
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init, out_shardings=state_shardings)(p)

      def step(p, s):
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

      jitted = jax.jit(
        step,
        in_shardings=(param_shardings, state_shardings),
        out_shardings=(param_shardings, state_shardings),
      )
      for _ in range(3):
        p, state = jitted(p, state)
      hlo = jitted.lower(p, state).compile().as_text()
    return p, state, hlo

  got, state, hlo = run(ours, shardings)
  want, _, _ = run(optax.adamw(1e-2, weight_decay=0.1), None)
  _assert_split_as_params(state, mesh)
  assert not re.search(r'all-gather|all-reduce', hlo)
  for name in SPECS:
    w = np.asarray(want[name])
    tol = 2 * 3 * F32_EPS * np.max(np.abs(w))
    np.testing.assert_allclose(got[name], w, rtol=0, atol=tol, err_msg=name)


def test_state_shardings_name_host_memory_for_ours_only():
  # Under optax's wrappers: ours in pinned_host (scalars on the device),
  # the wrapper's accumulator in device memory, split as the parameters.
  mesh = _mesh(AxisType.Auto)
  params = _params(mesh)
  tx = optax.MultiSteps(
    optax.chain(optax.clip_by_global_norm(1.0), superoffload.adamw(1e-2)), 2
  )
  shardings = superoffload.state_shardings(tx, params)
  inner = shardings.inner_opt_state[1]
  assert inner.mu['w'].memory_kind == HOST
  assert inner.mu['w'].spec == SPECS['w']
  assert inner.count.memory_kind == 'device'
  assert shardings.acc_grads['w'].memory_kind == 'device'
  assert shardings.acc_grads['w'].spec == SPECS['w']
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    params,
  )
  assert superoffload.state_shardings(tx, abstract) == shardings


def test_state_shardings_on_one_device_and_of_params_on_two_meshes():
  shardings = superoffload.state_shardings(
    superoffload.adamw(1e-2), {'w': jnp.zeros((4, 2)), 's': jnp.zeros(())}
  )
  assert shardings[0].mu['w'].memory_kind == HOST
  assert shardings[0].mu['s'].memory_kind == 'device'  # Scalars stay.
  a = jax.make_mesh((2, 4), ('x', 'y'), axis_types=(AxisType.Auto,) * 2)
  b = jax.make_mesh((4, 2), ('x', 'y'), axis_types=(AxisType.Auto,) * 2)
  params = {
    'u': jax.device_put(jnp.zeros(8), NamedSharding(a, P('x'))),
    'v': jax.device_put(jnp.zeros(8), NamedSharding(b, P('x'))),
  }
  with pytest.raises(ValueError, match=r"more than one mesh.*\['u'\]"):
    superoffload.state_shardings(superoffload.adamw(1e-2), params)


def test_a_state_placed_in_device_memory_by_a_trainers_jit_is_refused():
  # The trainer's own rules name device memory: the step says which leaf
  # and what to do, instead of stepping the state on the device.
  mesh = _mesh(AxisType.Auto)
  params = _params(mesh)
  tx = superoffload.adamw(1e-2)
  on_device = jax.tree.map(
    lambda s: s.with_memory_kind('device'),
    superoffload.state_shardings(tx, params),
  )
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init, out_shardings=on_device)(params)
    with pytest.raises(
      ValueError, match=r"leaf master\['b'\] \(and 8 more\) came in device"
    ):
      jax.jit(tx.update)(params, state, params)


def test_a_step_lowered_ahead_of_time_from_the_inits_shardings():
  # AOT, as capacity and memory planning do: the state's types come from
  # the compiled init's output shardings. One made in the jit (parameters
  # from zeros) comes out single-device, which a jax.ShapeDtypeStruct
  # types as device memory: refused, the message naming the way out;
  # state_shardings' NamedShardings lower with the state on the host.
  tx = superoffload.adamw(1e-2)
  params = {'w': jnp.ones((8, 4)), 'b': jnp.ones((4,))}
  make = lambda: tx.init(jax.tree.map(jnp.zeros_like, params))  # noqa: E731
  shapes = jax.eval_shape(make)
  out = jax.jit(make).lower().compile().output_shardings

  def lower(shardings):
    state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes,
      shardings,
    )
    return jax.jit(tx.update).lower(params, state, params)

  with pytest.raises(ValueError, match='only with a NamedSharding'):
    lower(out)
  compiled = lower(superoffload.state_shardings(tx, params)).compile()
  state_in = compiled.input_shardings[0][1]
  assert state_in[0].mu['w'].memory_kind == HOST
  assert state_in[1].master['w'].memory_kind == HOST
