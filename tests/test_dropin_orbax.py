"""docs/orbax.md's Flax NNX block runs, as a user would run it.

The block trains `nnx.Optimizer(model, optax.MultiSteps(optax.chain(
optax.clip_by_global_norm(1.0), superoffload.adamw(schedule)), 2))`, saves
with Orbax after five steps and resumes in fresh objects (a concrete and an
`nnx.eval_shape` target). It asserts that the resumed losses equal the
uninterrupted run's and stay within 1e-5 relative of `optax.adamw`'s; the
test checks the same from what it leaves behind.
"""

import pathlib
import re

_PAGE = pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'orbax.md'
_BLOCK = re.compile(r'^```python\n(.*?)^```$', re.DOTALL | re.MULTILINE)


def test_the_orbax_recipe_resumes_as_the_uninterrupted_run():
  (code,) = _BLOCK.findall(_PAGE.read_text())
  namespace: dict = {}
  exec(compile(code, str(_PAGE), 'exec'), namespace)
  want, theirs = namespace['uninterrupted'], namespace['optax_losses']
  assert len(want) == 12 and want[-1] < want[0]
  assert set(namespace['resumed']) == {'concrete', 'eval_shape'}
  for got in namespace['resumed'].values():
    assert got == want
  for ours, ref in zip(want, theirs, strict=True):
    assert abs(ours - ref) <= 1e-5 * abs(ref)
