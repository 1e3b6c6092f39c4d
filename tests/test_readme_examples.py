"""Every Python code block of the README and the guide's pages runs.

Each block is a whole program that fits a linear layer to a constant target
and leaves its last loss in `loss`. .ci/docs.sh runs this file beside the
docs build, and the suite runs it everywhere.
"""

import math
import pathlib
import re

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PAGES = ('README.md', 'docs/getting_started.md', 'docs/gpu.md')
_BLOCK = re.compile(r'^```python\n(.*?)^```$', re.DOTALL | re.MULTILINE)


def _blocks(page: str) -> list[str]:
  return _BLOCK.findall((_ROOT / page).read_text())


_EXAMPLES = [
  pytest.param(code, id=f'{page}:{i}')
  for page in _PAGES
  for i, code in enumerate(_blocks(page))
]


def test_each_page_has_examples_and_getting_started_covers_each_api():
  assert _blocks('README.md')
  examples = _blocks('docs/getting_started.md')
  for loop in ('tx.update', 'nnx.Optimizer', 'TrainState'):
    assert any(loop in code for code in examples), loop
  for code in examples:
    assert 'superoffload.adamw' in code


@pytest.mark.parametrize('code', _EXAMPLES)
def test_example_runs_and_fits(code, request):
  pytest.importorskip('jax_superoffload')
  namespace: dict = {}
  exec(compile(code, request.node.callspec.id, 'exec'), namespace)
  loss = float(namespace['loss'])
  # Fitting a constant target with a linear layer: the loss goes to ~0.
  assert math.isfinite(loss) and loss < 0.05, loss
