"""optax's own `ShardingTest`, run on superoffload's `adam` and `adamw`.

The test (optax/_src/sharding_test.py) inits each optimizer of its table on
abstract params (`jax.ShapeDtypeStruct`) and, on an 8-device Explicit-axes
mesh, checks that the state's types (sharding included) are the same from
`init` and `update`, eager and jitted. Its source is read from the
installed optax, its `optax` is optax with our adam and adamw, and only
the cases of those two run here.

Every case passes, as optax's do. Before the state took optax's layout the
sharding-in-types ones failed: the eager update's `shard_map` refused its
move to host memory, and a jitted init's zero moments lost the split from
their types (tests/test_dropin_meshes.py checks both on their own).
"""

import os

import optax
import pytest
import test_optax_alias_peer as alias_peer

_FLAGS = os.environ.get('XLA_FLAGS')  # The module sets its own at import.
# Its check compares version strings: '0.10.2' < '0.7.2', so optax's own
# run skips the sharding-in-types tests on every JAX this project runs on.
_VERSION_CHECK = ("jax.__version__ < '0.7.2'", 'False')
_PEER = alias_peer.load_peer(
  'optax._src.sharding_test', (_VERSION_CHECK,), optax=alias_peer.swapped(optax)
)
if _FLAGS is not None:
  os.environ['XLA_FLAGS'] = _FLAGS
CASES = [
  f'{test}_{name}'
  for test in (
    'test_init_with_abstract_input',
    'test_state_sharding_type_init_match_update',
    'test_state_sharding_type_preserved_with_jit',
  )
  for name in alias_peer.SELECTED
]


def test_the_adam_cases_are_there():
  for name in alias_peer.SELECTED:
    assert _PEER.OPTIMIZERS[name].init.__qualname__.startswith('_counted')
  assert set(CASES) <= set(dir(_PEER.ShardingTest))


@pytest.mark.parametrize('case', CASES)
def test_sharding(case):
  alias_peer.run_peer(_PEER.ShardingTest, case)
