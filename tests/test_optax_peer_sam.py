"""optax's own `SAMTest`, run with superoffload's `adam` as its adversary.

optax/contrib/_sam_test.py runs sharpness-aware minimisation (`sam`) on a
parabola with sgd as the base optimizer and sgd or adam (chained after
`normalize`) as the adversarial one. Its source is read from the installed
optax, its adversary table is cut to the adam row, and that adam is ours.
"""

import pytest
import test_optax_alias_peer as alias_peer
from optax._src import alias

_SGD_ROW = (
  "    {'adv_opt_name': 'sgd', 'adv_opt_kwargs': {'learning_rate': 1e-5}},\n",
  '',
)
_PEER = alias_peer.load_peer(
  'optax.contrib._sam_test', (_SGD_ROW,), alias=alias_peer.swapped(alias)
)
CASES = sorted(n for n in dir(_PEER.SAMTest) if n.startswith('test_'))


def test_only_the_adam_adversary_is_there():
  rows = _PEER._ADVERSARIAL_OPTIMIZERS_UNDER_TEST
  assert [r['adv_opt_name'] for r in rows] == ['adam']
  assert CASES == ['test_optimization0', 'test_optimization1']  # opaque_mode


@pytest.mark.parametrize('case', CASES)
def test_sam(case):
  alias_peer.run_peer(_PEER.SAMTest, case)
