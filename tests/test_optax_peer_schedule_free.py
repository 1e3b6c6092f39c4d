"""optax's own `ScheduleFreeTest`, run on superoffload's `adamw`.

Its `test_schedule_free_adamw` (optax/contrib/_schedule_free_test.py)
checks that `schedule_free` wrapped around `adamw(b1=0)` steps as optax's
`schedule_free_adamw` does. Its source is read from the installed optax
and run with our adamw in the wrapper; only its cases that build adam or
adamw run here.
"""

import pytest
import test_optax_alias_peer as alias_peer
from optax._src import alias

_PEER = alias_peer.load_peer(
  'optax.contrib._schedule_free_test', alias=alias_peer.swapped(alias)
)
CASES = alias_peer.cases_using(_PEER, 'ScheduleFreeTest', r'alias\.adamw?\b')


def test_the_adamw_case_is_there():
  assert CASES == ['test_schedule_free_adamw'], CASES


@pytest.mark.parametrize('case', CASES)
def test_schedule_free(case):
  alias_peer.run_peer(_PEER.ScheduleFreeTest, case)
