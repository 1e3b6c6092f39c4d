"""optax's own `ContribTest`, run with superoffload's `adam` and `adamw`.

optax/contrib/_common_test.py builds adam and adamw only as the base of
its `mechanize` rows. Its source is read from the installed optax, its
optimizer tables are cut to those rows, and their adam and adamw are ours.
"""

import collections
import re

import pytest
import test_optax_alias_peer as alias_peer
from optax._src import alias

_CUT = (
  '_MAIN_OPTIMIZERS_UNDER_TEST = tuple(_MAIN_OPTIMIZERS_UNDER_TEST)\n',
  '_MAIN_OPTIMIZERS_UNDER_TEST = tuple(_MAIN_OPTIMIZERS_UNDER_TEST)\n'
  '_ALL_OPTIMIZERS_UNDER_TEST = tuple(\n'
  '    o for o in _ALL_OPTIMIZERS_UNDER_TEST\n'
  f"    if o['opt_name'] in {alias_peer.SELECTED!r})\n",
)
_PEER = alias_peer.load_peer(
  'optax.contrib._common_test',
  (_CUT,),
  alias=alias_peer.swapped(alias),
)
# The tests over _MAIN_OPTIMIZERS_UNDER_TEST (contrib's own) build no adam.
_MAIN_ONLY = (
  'test_optimizers_can_be_wrapped_in_inject_hyperparams',
  'test_preserve_dtype',
  'test_gradient_accumulation',
)
CASES = sorted(
  n
  for n in dir(_PEER.ContribTest)
  if n.startswith('test_') and not n.startswith(_MAIN_ONLY)
)


def test_only_the_adam_rows_are_there():
  rows = _PEER._ALL_OPTIMIZERS_UNDER_TEST
  assert [(r['opt_name'], r['wrapper_name']) for r in rows] == [
    ('adam', 'mechanize'),
    ('adamw', 'mechanize'),
  ]
  counts = collections.Counter(re.sub(r'\d+$', '', n) for n in CASES)
  assert counts == {
    'test_optimizers': 8,  # 2 rows x 4 targets.
    'test_state_shape_dtype_shard_stability': 8,
    'test_optimizers_accept_extra_args': 4,  # 2 rows x wrap or not.
    'test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_'
    'such': 2,
  }, counts


@pytest.mark.parametrize('case', CASES)
def test_contrib(case):
  alias_peer.run_peer(_PEER.ContribTest, case)
