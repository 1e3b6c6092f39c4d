"""optax's tests of the wrappers users put around Adam, run on ours.

optax's `AccumulationTest` (MultiSteps; optax/transforms/_accumulation_test.py)
and its combining tests (`chain`, `partition` with extra args;
transforms/_combining_test.py and the older _src/combine_test.py) are read
from the installed optax and run with superoffload's adam and adamw where
they build optax's. Only their cases that build them run here.

`test_extra_args` (both modules) inits and steps Adam on Python ints
(`{'a': 1, 'b': 2}`): integer leaves take optax's path, as optax steps
them (tests/test_dropin_kinds_int.py checks the numbers).

`test_multi_steps_mixed_precision` steps MultiSteps eagerly for 9 dtype
pairs: about 35 s a case on a loaded 2-core VM (optax's own: 21 s).
"""

import pytest
import test_optax_alias_peer as alias_peer
from optax._src import alias

_ADAM = r'alias\.adamw?\b|getattr\(alias, opt_name\)'
_PEERS = {
  name: alias_peer.load_peer(name, alias=alias_peer.swapped(alias))
  for name in (
    'optax.transforms._accumulation_test',
    'optax.transforms._combining_test',
    'optax._src.combine_test',
  )
}
CASES = [
  (name, cls, case)
  for name, module in _PEERS.items()
  for cls in ('AccumulationTest', 'ExtraArgsTest', 'PartitionTest')
  if hasattr(module, cls)
  for case in alias_peer.cases_using(module, cls, _ADAM)
  # Its use_extra_label rows: partition refuses the labels before any init.
  if case not in ('test_labels_mismatch2', 'test_labels_mismatch3')
]


def test_the_cases_that_build_adam_are_there():
  cases = [f'{n.split(".")[-1]}.{t}' for n, _, t in CASES]
  mismatch = ['test_labels_mismatch0', 'test_labels_mismatch1']
  assert cases == [
    '_accumulation_test.test_multi_steps_mixed_precision0',
    '_accumulation_test.test_multi_steps_mixed_precision1',
    *(
      f'{m}.{c}'
      for m in ('_combining_test', 'combine_test')
      for c in ('test_extra_args', *mismatch)
    ),
  ], cases


@pytest.mark.parametrize(
  ('name', 'cls', 'case'), CASES, ids=[f'{n[6:]}-{t}' for n, _, t in CASES]
)
def test_wrapper(name, cls, case):
  alias_peer.run_peer(getattr(_PEERS[name], cls), case)
