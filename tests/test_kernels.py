"""kernels.adam_step through XLA FFI: numbers, transformations, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_superoffload import _grace_adam
from jax_superoffload import kernels
from jax_superoffload._src.core import hyperparams
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import grace_adam


def numpy_adamw(
  master,
  grad,
  mu,
  nu,
  *,
  t,
  lr,
  b1,
  b2,
  eps,
  eps_root,
  wd,
  nesterov,
  grad_scale,
):
  """AdamW by its definition, in float64 (independent of the package)."""
  g = grad.astype(np.float64) * grad_scale
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * g * g
  if nesterov:
    mu_hat = b1 * mu / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
  else:
    mu_hat = mu / (1 - b1**t)
  nu_hat = nu / (1 - b2**t)
  update = mu_hat / (np.sqrt(nu_hat + eps_root) + eps) + wd * master
  return master - lr * update, mu, nu


def random_state(n, seed=0):
  rng = np.random.default_rng(seed)
  master = rng.standard_normal(n).astype(np.float32)
  return master, np.zeros(n, np.float32), np.zeros(n, np.float32)


def random_grad(rng, shape, dtype):
  g = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 1, shape)
  return jnp.asarray(g.astype(np.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=('nesterov', 'lowp_dtype'))
def jitted_step(
  master, grad, mu, nu, count, lr, wd, scale, *, nesterov, lowp_dtype
):
  return kernels.adam_step(
    master,
    grad,
    mu,
    nu,
    count=count,
    learning_rate=lr,
    weight_decay=wd,
    grad_scale=scale,
    eps_root=1e-12,
    nesterov=nesterov,
    lowp_dtype=lowp_dtype,
  )


@pytest.mark.parametrize('n', [0, 1, 7, 22, 64, 1000, 2**18 + 3])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize('nesterov', [False, True])
def test_matches_float64_adamw_over_30_steps(n, grad_dtype, nesterov):
  rng = np.random.default_rng(n)
  master, mu, nu = random_state(n)
  ref = [
    master.astype(np.float64),
    mu.astype(np.float64),
    nu.astype(np.float64),
  ]
  state = [jnp.asarray(master), jnp.asarray(mu), jnp.asarray(nu)]
  b1, b2, eps = 0.9, 0.999, 1e-8
  for step in range(30):
    lr = 1e-2 / (1 + step)
    wd = 0.01
    scale = 0.5 if step % 3 == 0 else 1.0
    grad = random_grad(rng, (n,), grad_dtype)
    state = list(
      jitted_step(
        state[0],
        grad,
        state[1],
        state[2],
        step,
        lr,
        wd,
        scale,
        nesterov=nesterov,
        lowp_dtype=None,
      )
    )
    ref = list(
      numpy_adamw(
        ref[0],
        np.asarray(grad.astype(jnp.float32)),
        ref[1],
        ref[2],
        t=step + 1,
        lr=np.float32(lr),
        b1=b1,
        b2=b2,
        eps=eps,
        eps_root=1e-12,
        wd=np.float32(wd),
        nesterov=nesterov,
        grad_scale=scale,
      )
    )
  # Trajectories of 30 fp32 steps: a few ulps of the values' magnitude.
  np.testing.assert_allclose(state[0], ref[0], rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(state[2], ref[2], rtol=2e-6, atol=1e-12)
  mu_scale = np.abs(ref[1]).max(initial=0) + 1e-30
  np.testing.assert_allclose(state[1], ref[1], rtol=0, atol=4e-6 * mu_scale)


@pytest.mark.parametrize('lowp', [jnp.bfloat16, jnp.float16])
def test_lowp_copy_is_master_rounded_to_nearest_even(lowp):
  n = 4099
  rng = np.random.default_rng(1)
  master, mu, nu = (jnp.asarray(x) for x in random_state(n))
  grad = random_grad(rng, (n,), jnp.float32)
  new_master, _, _, copy = jitted_step(
    master, grad, mu, nu, 0, 1e-3, 0.0, 1.0, nesterov=False, lowp_dtype=lowp
  )
  assert copy.dtype == lowp
  # ml_dtypes' float32 -> bfloat16/float16 casts round to nearest even.
  expected = np.asarray(new_master).astype(lowp)
  np.testing.assert_array_equal(
    np.asarray(copy).view(np.uint16), expected.view(np.uint16)
  )


def test_reference_matches_kernel():
  n = 3001
  rng = np.random.default_rng(2)
  args = [jnp.asarray(x) for x in random_state(n)]
  for step in range(5):
    grad = random_grad(rng, (n,), jnp.bfloat16)
    kw = dict(
      count=step,
      learning_rate=1e-3,
      weight_decay=0.1,
      nesterov=True,
      lowp_dtype=jnp.bfloat16,
    )
    ours = kernels.adam_step(args[0], grad, args[1], args[2], **kw)
    ref = kernels.adam_step_reference(args[0], grad, args[1], args[2], **kw)
    for a, b in zip(ours, ref, strict=True):
      np.testing.assert_allclose(
        np.asarray(a, np.float32),
        np.asarray(b, np.float32),
        rtol=1e-6,
        atol=1e-7,
      )
    args = list(ours[:3])


def test_reference_handles_float64():
  with jax.enable_x64(True):
    master = jnp.linspace(-1, 1, 17, dtype=jnp.float64)
    grad = jnp.cos(master)
    out = kernels.adam_step_reference(
      master,
      grad,
      jnp.zeros_like(master),
      jnp.zeros_like(master),
      count=0,
      learning_rate=0.1,
    )
    assert out[0].dtype == jnp.float64
    ref = numpy_adamw(
      np.asarray(master),
      np.asarray(grad),
      0.0,
      0.0,
      t=1,
      lr=0.1,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      eps_root=0.0,
      wd=0.0,
      nesterov=False,
      grad_scale=1.0,
    )
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-14)


def test_nonfinite_gradients_propagate_like_optax():
  n = 100
  master, mu, nu = (jnp.asarray(x) for x in random_state(n))
  grad = jnp.ones(n).at[3].set(jnp.nan).at[50].set(jnp.inf)
  new_master, new_mu, _ = kernels.adam_step(
    master, grad, mu, nu, count=0, learning_rate=1e-3
  )
  bad = np.zeros(n, bool)
  bad[[3, 50]] = True
  assert np.isnan(np.asarray(new_master)[bad]).all()
  assert np.isfinite(np.asarray(new_master)[~bad]).all()
  assert not np.isfinite(np.asarray(new_mu)[bad]).any()


def test_no_recompile_when_count_and_learning_rate_change():
  master, mu, nu = (jnp.asarray(x) for x in random_state(64))
  step = jax.jit(
    lambda m, g, a, b, c, lr: kernels.adam_step(
      m, g, a, b, count=c, learning_rate=lr
    )
  )
  for i in range(4):
    master, mu, nu = step(
      master, jnp.ones(64), mu, nu, jnp.int32(i), jnp.float32(1e-3 * (i + 1))
    )
  assert step._cache_size() == 1


def test_donation_updates_in_place():
  n = 1 << 16
  step = jax.jit(
    lambda m, g, a, b: kernels.adam_step(
      m, g, a, b, count=0, learning_rate=1e-3
    ),
    donate_argnums=(0, 2, 3),
  )
  args = [jnp.asarray(x) for x in random_state(n)]
  grad = jnp.ones(n)
  compiled = step.lower(args[0], grad, args[1], args[2]).compile()
  hlo = compiled.as_text()
  assert f'custom_call_target="{grace_adam.ADAM_STEP_TARGET}"' in hlo
  # The custom call's outputs alias its inputs, and the entry computation's
  # outputs alias the donated parameters: no copies of the state.
  assert 'output_to_operand_aliasing' in hlo
  assert 'input_output_alias' in hlo
  assert ' copy(' not in hlo and ' copy-start(' not in hlo
  pointers = [a.unsafe_buffer_pointer() for a in args]
  out = step(args[0], grad, args[1], args[2])
  assert [o.unsafe_buffer_pointer() for o in out] == pointers


def test_vmap_matches_per_example_steps():
  rng = np.random.default_rng(3)
  master = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)
  grad = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)
  lrs = jnp.asarray([1e-3, 1e-2, 1e-1], jnp.float32)
  counts = jnp.asarray([0, 5, 9], jnp.int32)

  def one(m, g, lr, c):
    return kernels.adam_step(
      m, g, jnp.zeros_like(m), jnp.zeros_like(m), count=c, learning_rate=lr
    )

  batched = jax.vmap(one)(master, grad, lrs, counts)
  for i in range(3):
    single = one(master[i], grad[i], lrs[i], counts[i])
    for a, b in zip(batched, single, strict=True):
      np.testing.assert_array_equal(a[i], b)
  # Unbatched scalars with batched arrays, and nested vmap.
  nested = jax.vmap(jax.vmap(lambda m, g: one(m, g, 1e-3, 0)))(master, grad)
  np.testing.assert_array_equal(
    nested[0][2, 4], one(master[2, 4], grad[2, 4], 1e-3, 0)[0]
  )


def test_shard_map_runs_per_shard():
  mesh = jax.make_mesh((8,), ('data',))
  n = 8 * 1001
  spec = NamedSharding(mesh, P('data'))
  master, mu, nu = (
    jax.device_put(jnp.asarray(x), spec) for x in random_state(n)
  )
  grad = jax.device_put(jnp.linspace(-1, 1, n, dtype=jnp.float32), spec)

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=P('data'), out_specs=P('data')
  )
  def sharded(m, g, a, b):
    return kernels.adam_step(m, g, a, b, count=0, learning_rate=1e-3)

  out = sharded(master, grad, mu, nu)
  assert out[0].sharding.is_equivalent_to(spec, 1)
  ref = kernels.adam_step(
    *(np.asarray(x) for x in (master, grad, mu, nu)),
    count=0,
    learning_rate=1e-3,
  )
  np.testing.assert_array_equal(out[0], ref[0])


def _per_leaf(flat, grads):
  """`flat` cut into one array per gradient, of its shape."""
  cuts = np.cumsum([g.size for g in grads])[:-1]
  return [
    jnp.asarray(x).reshape(g.shape)
    for x, g in zip(np.split(np.asarray(flat), cuts), grads, strict=True)
  ]


# The step of the segment tests.
SEGMENT_STEP = Hyperparams(
  count=2,
  learning_rate=1e-3,
  b1=0.9,
  b2=0.999,
  eps=1e-8,
  eps_root=0.0,
  weight_decay=0.01,
  nesterov=False,
)


def segments_step(master, mu, nu, grads, *, keep_nonfinite, compute_sumsq):
  """One kernel call over the leaves; the state comes back flat again."""
  out = grace_adam.adam_step_segments(
    _per_leaf(master, grads),
    _per_leaf(mu, grads),
    _per_leaf(nu, grads),
    grads,
    None,
    SEGMENT_STEP.replace(grad_scale=0.5),
    keep_nonfinite=keep_nonfinite,
    compute_sumsq=compute_sumsq,
  )
  flat = [jnp.concatenate([jnp.ravel(x) for x in xs]) for xs in out[:3]]
  return (*flat, out[3], out[4])


@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize('keep_nonfinite', [False, True])
def test_segments_sum_of_squares(grad_dtype, keep_nonfinite):
  rng = np.random.default_rng(11)
  # Leaves that straddle the kernel's 2**18-element work chunks.
  sizes = [100003, 7, 2**18 + 5, 1, 4099]
  master, mu, nu = random_state(sum(sizes))
  grads = [random_grad(rng, (s,), grad_dtype) for s in sizes]
  step = functools.partial(
    segments_step, master, mu, nu, grads, keep_nonfinite=keep_nonfinite
  )
  summed = step(compute_sumsq=True)
  plain = step(compute_sumsq=False)
  # The same pass: the state is the plain step's, bit for bit.
  for a, b in zip(summed[:3], plain[:3], strict=True):
    np.testing.assert_array_equal(a, b)
  assert float(plain[4][0]) == 0.0
  # The squares the kernel forms (fp32 g * 0.5, squared in fp32), in double.
  want = sum(
    np.sum(
      np.square(np.asarray(g, np.float32) * np.float32(0.5)), dtype=np.float64
    )
    for g in grads
  )
  got = float(summed[4][0])
  # fp32 lanes of at most 64 squares, then double, then one fp32 rounding.
  assert abs(got - want) <= 65 * 2.0**-24 * want
  # Fixed chunks and a fixed order of additions: the same bits every time.
  again = step(compute_sumsq=True)
  assert np.asarray(again[4]).tobytes() == np.asarray(summed[4]).tobytes()


@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_fp32_params_read_as_the_master_give_the_plain_step(grad_dtype):
  # With fp32 params the kernel reads them in the master's place and writes
  # the state with streaming stores from the first aligned element: the
  # bits must be those of the plain in-place step from the same master.
  rng = np.random.default_rng(12)
  sizes = [100003, 7, 2**18 + 5, 1, 4099, 16]
  master, mu, nu = random_state(sum(sizes))
  grads = [random_grad(rng, (s,), grad_dtype) for s in sizes]
  hyper = SEGMENT_STEP
  cut = functools.partial(_per_leaf, grads=grads)
  plain = grace_adam.adam_step_segments(
    cut(master), cut(mu), cut(nu), grads, None, hyper
  )
  stale = cut(np.asarray(master) + 1.0)  # Not read: the params are.
  from_params = grace_adam.adam_step_segments(
    stale, cut(mu), cut(nu), grads, None, hyper, params=cut(master)
  )
  for a, b in zip(plain[:3], from_params[:3], strict=True):
    for x, y in zip(a, b, strict=True):
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize('keep_nonfinite', [False, True])
@pytest.mark.parametrize(
  ('bad', 'check'),
  [
    (np.nan, np.isnan),
    (np.inf, np.isposinf),
    (-np.inf, np.isposinf),
    (1e20, np.isposinf),  # Finite, but its square overflows fp32.
  ],
)
def test_segments_sum_of_squares_is_not_finite(keep_nonfinite, bad, check):
  sizes = [1000, 2**18 + 3]
  master, mu, nu = random_state(sum(sizes))
  grads = [jnp.ones(s, jnp.float32) for s in sizes]
  grads[1] = grads[1].at[2**18 - 999].set(bad)  # In the bucket's 2nd chunk.
  out = segments_step(
    master, mu, nu, grads, keep_nonfinite=keep_nonfinite, compute_sumsq=True
  )
  assert check(float(out[4][0]))


def test_zero_size_and_scalar_arrays():
  for shape in [(0,), (3, 0), ()]:
    x = jnp.ones(shape, jnp.float32)
    out = kernels.adam_step(
      x,
      x,
      jnp.zeros(shape),
      jnp.zeros(shape),
      count=0,
      learning_rate=0.1,
      lowp_dtype=jnp.bfloat16,
    )
    assert [o.shape for o in out] == [shape] * 4


@pytest.mark.parametrize(
  ('kwargs', 'error', 'match'),
  [
    (dict(grad=jnp.ones(4)), ValueError, r'grad has shape \(4,\).*\(3,\)'),
    (dict(mu=jnp.ones(3, jnp.bfloat16)), TypeError, 'mu must have'),
    (dict(master=jnp.ones(3, jnp.float16)), TypeError, 'master must be'),
    (dict(grad=jnp.ones(3, jnp.int32)), TypeError, 'grad must be'),
    (dict(b1=1.0), ValueError, r'b1 must be in \[0, 1\), got 1.0'),
    (dict(b2=-0.1), ValueError, 'b2 must be in'),
    (dict(learning_rate=-1.0), ValueError, 'learning_rate must be non-neg'),
    (dict(eps=-1e-8), ValueError, 'eps must be non-negative'),
    (dict(lowp_dtype=jnp.float32), TypeError, 'lowp_dtype must be'),
    (dict(count=1.5), TypeError, 'count must be an integer'),
    (dict(learning_rate=jnp.ones(2)), ValueError, 'learning_rate must be a'),
  ],
)
def test_bad_input_raises_before_native_code(kwargs, error, match):
  args = dict(
    master=jnp.ones(3),
    grad=jnp.ones(3),
    mu=jnp.zeros(3),
    nu=jnp.zeros(3),
    count=0,
    learning_rate=1e-3,
  )
  args.update(kwargs)
  with pytest.raises(error, match=match):
    kernels.adam_step(**args)


def test_stream_roofline_moves_bytes():
  m, g, a, b = (jnp.full(5, v, jnp.float32) for v in (1.0, 2.0, 3.0, 4.0))
  out = kernels.stream_roofline(m, g, a, b)
  np.testing.assert_array_equal(out[0], 3.0)
  np.testing.assert_array_equal(out[1], 4.0)
  np.testing.assert_array_equal(out[2], 3.0)


def test_instruction_set_is_reported():
  assert kernels.instruction_set() in (
    'scalar',
    'avx2',
    'avx512',
    'neon',
    'sve',
  )


def test_the_scalar_order_is_the_kernels():
  # Declared once, in C++ (kPackedScalars); Python packs in that order.
  assert hyperparams.PACKED_NAMES == _grace_adam.PACKED_SCALARS
  assert len(set(hyperparams.PACKED_NAMES)) == 9
  hyper = hyperparams.Hyperparams(
    count=0,
    learning_rate=0.5,
    b1=0.25,
    b2=0.125,
    eps=3.0,
    eps_root=4.0,
    weight_decay=5.0,
    grad_scale=6.0,
  )
  packed = np.asarray(hyper.packed())
  for i, name in enumerate(hyperparams.PACKED_NAMES):
    assert packed[i] == np.float32(hyper.scalar(name)), name
  assert hyper.scalar('one_minus_b1') == 0.75


def test_a_single_leaf_step_is_a_segments_call():
  m, g, a, b = (jnp.ones(8, jnp.float32) for _ in range(4))
  hlo = (
    jax.jit(lambda *x: kernels.adam_step(*x, count=0, learning_rate=1e-3))
    .lower(m, g, a, b)
    .as_text()
  )
  assert grace_adam.ADAM_STEP_SEGMENTS_TARGET in hlo
  assert 'num_leaves = 1' in hlo
