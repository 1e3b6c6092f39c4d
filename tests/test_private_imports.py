"""Only the library and its tests import jax_superoffload._src.

experiments/ and configs/ use the public API, as a user's code would.
"""

import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PRIVATE = re.compile(
  r'^\s*(from\s+jax_superoffload\._src\b|import\s+jax_superoffload\._src\b'
  r'|from\s+jax_superoffload\s+import\s+_src\b)',
  re.MULTILINE,
)


def test_no_private_imports_outside_the_library_and_tests():
  files = [
    *(_ROOT / 'experiments').rglob('*.py'),
    *(_ROOT / 'configs').rglob('*.py'),
  ]
  assert len(files) > 30
  offenders = [
    f'{path.relative_to(_ROOT)}:{text[: m.start()].count(chr(10)) + 1}'
    for path in files
    for text in [path.read_text()]
    for m in _PRIVATE.finditer(text)
  ]
  assert not offenders, offenders
