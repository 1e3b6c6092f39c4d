"""optax's own `Float64Test`, run on superoffload's `adam` and `adamw`.

The test (optax/_src/float64_test.py) inits and steps each optimizer of its
table under `jax.jit` on a float32 and a float64 leaf (with x64 enabled)
and checks that the state and the parameters keep their dtypes. Its source
is read from the installed optax; its table's adam and adamw are ours, and
only those two cases run here.
"""

import jax
import pytest
import test_optax_alias_peer as alias_peer
from optax._src import alias

_PEER = alias_peer.load_peer(
  'optax._src.float64_test', alias=alias_peer.swapped(alias)
)
CASES = [
  f'test_mixed_dtype_input_outputs_{name}' for name in alias_peer.SELECTED
]


def test_the_adam_cases_are_there():
  table = {name: constr for name, constr, _ in _PEER.ALL_MODULES}
  for name in alias_peer.SELECTED:
    assert table[name].__wrapped__ is getattr(alias_peer.superoffload, name)
  assert set(CASES) <= set(dir(_PEER.Float64Test))


@pytest.mark.parametrize('case', CASES)
def test_float64(case):
  x64 = jax.config.jax_enable_x64
  try:  # The test turns x64 on, and off only if it passes.
    alias_peer.run_peer(_PEER.Float64Test, case)
  finally:
    jax.config.update('jax_enable_x64', x64)
