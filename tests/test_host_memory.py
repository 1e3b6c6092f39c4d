import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload._src.core import host_memory


@pytest.fixture
def fresh_form():
  host_memory.function_form.cache_clear()
  yield
  host_memory.function_form.cache_clear()


def _version(v: str) -> tuple[int, ...]:
  return tuple(int(x) for x in v.split('.')[:3] if x.isdigit())


def test_function_form_is_the_one_this_jax_has(fresh_form):
  form = host_memory.function_form()
  if _version(jax.__version__) >= (0, 12):
    assert form.__name__ == 'compute_on'
  elif _version(jax.__version__) >= (0, 10, 1):
    assert form.__name__ == 'compute_on2'


def test_function_form_follows_the_rename(monkeypatch, fresh_form):
  def compute_on(f=None, *, compute_type, out_memory_spaces):
    del compute_type, out_memory_spaces
    return f

  renamed = types.SimpleNamespace(compute_on=compute_on)
  monkeypatch.setattr(host_memory, '_compute_on', renamed)
  assert host_memory.function_form() is compute_on


def test_context_manager_only_is_refused_by_name(monkeypatch, fresh_form):
  def compute_on(compute_type):
    del compute_type

  monkeypatch.setattr(
    host_memory, '_compute_on', types.SimpleNamespace(compute_on=compute_on)
  )
  with pytest.raises(RuntimeError, match=r'needs jax >= 0\.10\.1'):
    host_memory.function_form()


def test_on_host_results_live_in_pinned_host():
  x = host_memory.to_host(jnp.arange(8.0))

  @jax.jit
  def f(x):
    return host_memory.on_host(lambda a: (a * 2, a + 1), x)

  doubled, plus_one = f(x)
  np.testing.assert_array_equal(doubled, np.arange(8.0) * 2)
  np.testing.assert_array_equal(plus_one, np.arange(8.0) + 1)
  assert {host_memory.memory_kind(y) for y in (doubled, plus_one)} == {
    host_memory.HOST_MEMORY_KIND
  }
