"""bf16 and 8-bit blockwise Adam moments against a float64 reference."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from jax_superoffload._src.core import moments
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import grace_adam
from tests import moments_reference as ref

FORMATS = {
  'mu_bf16': dict(mu_dtype=jnp.bfloat16),
  'bf16': dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
  '8bit': dict(moments_8bit=True),
}
HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, wd=0.1)
SHAPES = {'zero': (0,), 'one': (1,), 'b255': (255,), 'b256': (256,),
          'b257': (257,), 'k': (1000,), 'w': (37, 29),
          'scalar': ()}  # fmt: skip


def _params(rng) -> dict:
  params = {
    name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for name, shape in SHAPES.items()
  }
  params['half'] = jnp.asarray(rng.standard_normal((300,)), jnp.bfloat16)
  return params


def _grads(rng, params, step: int) -> dict:
  """Scales from 1e-3 to 1e4, alternating by step and within blocks."""
  out = {}
  for name, p in params.items():
    g = rng.standard_normal(p.shape)
    across = np.where(np.arange(p.size) % 3 == 0, 1e4, 1e-3).reshape(p.shape)
    g = g * (across if step % 2 else 1.0 / across) * (10.0 ** (step - 1))
    out[name] = jnp.asarray(g, p.dtype)
  return out


def _decoded(state, name: str, leaf: str) -> np.ndarray:
  codes = np.asarray(getattr(state, name)[leaf])
  if codes.dtype == np.uint8:
    scales = np.asarray(getattr(state, f'{name}_scales')[leaf])
    return ref.decode(codes, scales, signed=name == 'mu')
  return codes.astype(np.float64).reshape(-1)


def _check_leaf(state, leaf: str, want: dict) -> None:
  ref.check_close(
    np.asarray(state.master[leaf]).reshape(-1),
    want['master'],
    want['master_tol'],
    f'master {leaf}',
  )
  for name, signed in (('mu', True), ('nu', False)):
    stored = np.asarray(getattr(state, name)[leaf])
    what = f'{name} {leaf}'
    if stored.dtype == np.uint8:
      scales = np.asarray(getattr(state, f'{name}_scales')[leaf])
      ref.check_blockwise(
        stored, scales, want[name], want[f'{name}_tol'], signed, what
      )
    elif stored.dtype == jnp.bfloat16:
      ref.check_bf16(stored.reshape(-1), want[name], want[f'{name}_tol'], what)
    else:
      ref.check_close(
        stored.reshape(-1), want[name], want[f'{name}_tol'] + 0, what
      )


def reference_steps(state, grads, t: int, nesterov: bool, factor=1.0) -> dict:
  """Per leaf, the float64 step from `state` (decoded), gradients x factor."""
  return {
    leaf: ref.adam_step(
      np.asarray(state.master[leaf], np.float64).reshape(-1),
      _decoded(state, 'mu', leaf),
      _decoded(state, 'nu', leaf),
      np.asarray(grads[leaf], np.float64).reshape(-1) * factor,
      t=t,
      lr=HYPER['lr'],
      b1=HYPER['b1'],
      b2=HYPER['b2'],
      eps=HYPER['eps'],
      eps_root=HYPER['eps_root'],
      wd=HYPER['wd'],
      nesterov=nesterov,
    )
    for leaf in grads
  }


@pytest.mark.parametrize('nesterov', [False, True])
@pytest.mark.parametrize('fmt', list(FORMATS))
def test_steps_match_the_float64_reference(fmt, nesterov):
  rng = np.random.default_rng(7)
  params = _params(rng)
  tx = superoffload.adamw(
    HYPER['lr'],
    weight_decay=HYPER['wd'],
    nesterov=nesterov,
    bucket_bytes=4096,  # Several buckets, several leaves in some.
    **FORMATS[fmt],
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(1, 5):
    grads = _grads(rng, params, t)
    want = reference_steps(state, grads, t, nesterov)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for leaf in params:
      _check_leaf(state, leaf, want[leaf])
      if params[leaf].dtype == jnp.float32:  # bf16: see _exact_delta.
        np.testing.assert_array_equal(params[leaf], state.master[leaf])


@pytest.mark.parametrize(
  'executor, extra',
  [('xla_host', {}), ('device', {}), ('ffi', {'device_buckets': 1})],
)
@pytest.mark.parametrize('fmt', list(FORMATS))
def test_jnp_executors_store_moments_as_the_kernel(fmt, executor, extra):
  """The `jax.numpy` step (and its 8-bit codec) against the kernel's."""
  rng = np.random.default_rng(3)
  params = _params(rng)
  grads = _grads(rng, params, 1)
  states = {}
  for ex, kw in (('ffi', {}), (executor, extra)):
    tx = superoffload.adamw(
      1e-2, executor=ex, bucket_bytes=4096, **kw, **FORMATS[fmt]
    )
    state = tx.init(params)
    for _ in range(3):
      _, state = jax.jit(tx.update)(grads, state, params)
    states[(ex, bool(kw))] = state
  ours, theirs = states.values()
  for leaf in params:
    np.testing.assert_allclose(
      ours.master[leaf], theirs.master[leaf], rtol=1e-6, atol=1e-7
    )
    for name in ('mu', 'nu'):
      a = np.asarray(getattr(ours, name)[leaf])
      b = np.asarray(getattr(theirs, name)[leaf])
      assert a.dtype == b.dtype == moments.storage_dtypes(
        FORMATS[fmt].get('mu_dtype'), FORMATS[fmt].get('nu_dtype'),
        FORMATS[fmt].get('moments_8bit', False),
      )[name == 'nu'], leaf  # fmt: skip
      if a.dtype == np.uint8:
        # fp32 evaluation orders differ: a code off by one at most, where
        # the value sat on a rounding boundary.
        mask = 127 if name == 'mu' else 255
        diff = np.abs((a & mask).astype(int) - (b & mask).astype(int))
        assert diff.max(initial=0) <= 1, leaf
        assert diff.size == 0 or diff.mean() < 0.01, leaf
        np.testing.assert_allclose(
          getattr(ours, f'{name}_scales')[leaf],
          getattr(theirs, f'{name}_scales')[leaf],
          rtol=1e-5,
        )
      else:
        # One bf16 rounding apart at most.
        np.testing.assert_allclose(
          a.astype(np.float64), b.astype(np.float64), rtol=2**-7, err_msg=leaf
        )


def test_a_nonfinite_gradient_poisons_its_own_block_only():
  params = {'w': jnp.ones((3 * moments.BLOCK,), jnp.float32)}
  tx = superoffload.adamw(1e-2, moments_8bit=True)
  state = tx.init(params)
  g = np.full(params['w'].shape, 1e-3, np.float32)
  g[moments.BLOCK + 7] = np.nan
  _, state = jax.jit(tx.update)({'w': jnp.asarray(g)}, state, params)
  for name in ('mu', 'nu'):
    scales = np.asarray(getattr(state, f'{name}_scales')['w'])
    codes = np.asarray(getattr(state, name)['w'])
    assert np.isnan(scales[1]) and np.isfinite(scales[[0, 2]]).all()
    assert (codes[moments.BLOCK : 2 * moments.BLOCK] == 0).all()
    assert (codes[: moments.BLOCK] != 0).all()


def test_jnp_codec_matches_the_reference_table():
  rng = np.random.default_rng(0)
  for signed in (True, False):
    table = ref.code_table(signed)
    mids = (table[:-1] + table[1:]) / 2  # Every tie, and values around.
    y = np.concatenate([mids, table, rng.uniform(0, 1, 3000), [0.0, 1.0]])
    y = y[y <= 1.0]  # Codes above 1.0 exist, but y = x / max|x| <= 1.
    if signed:
      y = np.concatenate([y, -y])
    x = np.concatenate([y[:-1], [1.0]]).astype(np.float32)  # Scale 1.
    x = np.resize(x, (x.size // moments.BLOCK) * moments.BLOCK)
    x[:: moments.BLOCK] = 1.0  # Every block's scale is exactly 1.
    q = moments.quantize(jnp.asarray(x), signed)
    np.testing.assert_array_equal(np.asarray(q.scales), 1.0)
    want = [nearest(abs(float(v)), table) for v in x for nearest in [
      ref.nearest_code]]  # fmt: skip
    got = np.asarray(q.codes).astype(int)
    np.testing.assert_array_equal(got & 127 if signed else got, want)
    if signed:
      np.testing.assert_array_equal(got >= 128, np.signbit(x))  # -0 too.
    back = np.asarray(moments.dequantize(q, signed), np.float64)
    np.testing.assert_array_equal(
      back, ref.decode(got, np.ones(q.scales.size), signed)
    )


_THREADS_SCRIPT = textwrap.dedent(
  """
  import sys
  import jax, jax.numpy as jnp, numpy as np
  import jax_superoffload as so
  from tests.test_moments import FORMATS
  rng = np.random.default_rng(5)
  shape = (3, 700_001)
  params = {'w': jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  tx = so.adamw(1e-3, **FORMATS[sys.argv[2]])
  state = tx.init(params)
  for t in range(3):
    g = rng.standard_normal(shape) * 10.0 ** (3 * t - 3)
    _, state = jax.jit(tx.update)({'w': jnp.asarray(g, jnp.float32)}, state)
  leaves = jax.tree.leaves(state)
  np.savez(sys.argv[1], *[np.asarray(x) for x in leaves])
  """
)


@pytest.mark.parametrize('fmt', ['bf16', '8bit'])
def test_same_bits_on_one_and_on_all_cores(fmt, tmp_path):
  """The kernel's work chunks are fixed: the thread count changes nothing."""
  out = []
  for cores in ({0}, os.sched_getaffinity(0)):
    path = tmp_path / f'{len(cores)}.npz'
    subprocess.run(
      [
        'taskset',
        '-c',
        ','.join(map(str, sorted(cores))),
        sys.executable,
        '-c',
        _THREADS_SCRIPT,
        str(path),
        fmt,
      ],
      check=True,
      cwd=pathlib.Path(__file__).resolve().parents[1],
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    )
    out.append(np.load(path))
  one, every = out
  assert len(one.files) == len(every.files) > 0
  for k in one.files:
    a, b = (np.atleast_1d(x[k]).view(np.uint8) for x in (one, every))
    np.testing.assert_array_equal(a, b, k)


def test_interchange_with_optax():
  rng = np.random.default_rng(1)
  params = {'a': jnp.asarray(rng.standard_normal((513,)), jnp.float32)}
  grads = {'a': jnp.asarray(rng.standard_normal((513,)), jnp.float32)}
  theirs = optax.adamw(1e-2, mu_dtype=jnp.bfloat16)
  their_state = theirs.init(params)
  for _ in range(2):
    _, their_state = theirs.update(grads, their_state, params)
  adam = their_state[0]
  # bf16 mu from optax's mu_dtype: exact both ways.
  tx = superoffload.adamw(1e-2, mu_dtype=jnp.bfloat16)
  ours = superoffload.import_adam_state(tx, params, their_state)
  back = superoffload.export_adam_state(ours)
  np.testing.assert_array_equal(back.mu['a'], adam.mu['a'])
  np.testing.assert_array_equal(back.nu['a'], adam.nu['a'])
  assert back.mu['a'].dtype == jnp.bfloat16
  # 8-bit: each moment rounded to its code (lossy), decoded on export.
  tx8 = superoffload.adamw(1e-2, moments_8bit=True)
  ours8 = superoffload.import_adam_state(tx8, params, their_state)
  back8 = superoffload.export_adam_state(ours8)
  for name in ('mu', 'nu'):
    want = np.asarray(getattr(adam, name)['a'], np.float64)
    got = np.asarray(getattr(back8, name)['a'], np.float64)
    assert (
      got.dtype == np.float64 and getattr(back8, name)['a'].dtype == jnp.float32
    )
    # A code keeps 4 significant bits: relative error <= 2^-4, or the
    # smallest code's half step below 2^-14 of the block's largest.
    block_max = np.abs(want).max()
    np.testing.assert_array_less(
      np.abs(got - want), 2**-4 * np.abs(want) + 2**-30 * block_max + 1e-45
    )
  _, ours8 = jax.jit(tx8.update)(grads, ours8, params)
  assert int(ours8.count) == 3


def test_optax_tree_utils_see_param_shaped_moments():
  params = {'a': jnp.ones((4, 3)), 'b': jnp.ones((700,))}
  for fmt, kw in FORMATS.items():
    tx = superoffload.adamw(1e-3, **kw)
    state = tx.init(params)
    mu = optax.tree_utils.tree_get(state, 'mu')
    assert jax.tree.map(jnp.shape, mu) == jax.tree.map(jnp.shape, params), fmt
    shapes = optax.tree_map_params(tx, lambda p: p.shape, state)
    assert shapes.mu == jax.tree.map(jnp.shape, params), fmt


@pytest.mark.parametrize(
  'kwargs, message',
  [
    (dict(nu_dtype=jnp.float16), 'nu_dtype must be float32 or bfloat16'),
    (dict(nu_dtype=jnp.bfloat16), 'needs mu_dtype=bfloat16'),
    (dict(moments_8bit=True, mu_dtype=jnp.bfloat16), 'leave mu_dtype'),
    (dict(mu_dtype=jnp.float16, nu_dtype=jnp.bfloat16), "optax's path"),
  ],
)
def test_unsupported_moment_options_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    superoffload.adamw(1e-3, **kwargs)


def test_a_state_with_other_moments_is_refused():
  params = {'a': jnp.ones((10,))}
  fp32_state = superoffload.adamw(1e-3).init(params)
  with pytest.raises(ValueError, match='without 8-bit moments'):
    superoffload.adamw(1e-3, moments_8bit=True).update(
      params, fp32_state, params
    )
  with pytest.raises(ValueError, match=r"mu leaf \['a'\] is float32"):
    superoffload.adamw(1e-3, mu_dtype=jnp.bfloat16).update(
      params, fp32_state, params
    )


def test_kernel_and_jnp_codecs_give_the_same_bits():
  """With b1 = b2 = 0 the kernel stores g and g * g: its codes and scales
  must be the `jax.numpy` codec's, bit for bit, NaN, Inf and ties too.

  Not -0.0 or subnormal gradients: the kernel's 0 * mu + g makes -0.0 a
  +0.0, and XLA's threads flush subnormals to zero.
  """
  rng = np.random.default_rng(11)
  table = ref.code_table(True)
  ties = (table[:-1] + table[1:]) / 2
  g = np.concatenate([
    rng.standard_normal(2000) * 10.0 ** rng.integers(-20, 20, 2000),
    ties, -ties, table, [0.0, 3e38, -3e38],
    [np.inf, 1.0] + [0.5] * 254,  # An infinite block.
    [np.nan] + [2.0] * 255,  # A NaN block.
    np.zeros(256),  # A zero block.
  ]).astype(np.float32)  # fmt: skip
  n = g.size
  out = grace_adam.adam_step_lowp_segments(
    [jnp.zeros(n, jnp.float32)],
    [jnp.zeros(n, jnp.uint8)],
    [jnp.zeros(n, jnp.uint8)],
    ([jnp.zeros(moments.num_blocks(n), jnp.float32)],) * 2,
    [jnp.asarray(g)],
    None,
    Hyperparams(count=0, learning_rate=1e-3, b1=0.0, b2=0.0),
  )
  _, mu, nu, scales, _, _ = out
  gg = jnp.asarray(g) * jnp.asarray(g)
  for name, codes, s, want in (
    ('mu', mu[0], scales[0][0], moments.quantize(jnp.asarray(g), True)),
    ('nu', nu[0], scales[1][0], moments.quantize(gg, False)),
  ):
    np.testing.assert_array_equal(codes, want.codes, name)
    np.testing.assert_array_equal(
      np.asarray(s).view(np.uint32), np.asarray(want.scales).view(np.uint32)
    )
