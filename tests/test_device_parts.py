"""The prepared GPU command's dry run: every kind of part, tiny.

`experiments/device/run.sh --dry-run` runs each part in its own process at
tiny sizes on the CPU; this checks that each prints its result line with
the fields the GPU run will be read for, so that the command is ready the
next time a GPU is at hand.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments.device import check_parts

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = (
  'link opt:stream opt:stream:bfloat16 opt:stream+stv opt:stream+clip '
  'train:stream:noscan:4 train:stream+after-loop:scan:4 '
  'train:stream+held:scan:4 profile:stream'
)


@pytest.mark.device_image
def test_dry_run_prints_every_part(tmp_path):
  env = dict(os.environ)
  env['PATH'] = f'{pathlib.Path(sys.executable).parent}:{env["PATH"]}'
  env.update(OUT=str(tmp_path), PARTS=PARTS, PART_TIMEOUT_S='240')
  done = subprocess.run(
    ['bash', 'experiments/device/run.sh', '--dry-run'],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  lines = (tmp_path / 'parts.jsonl').read_text().splitlines()
  results = [json.loads(line) for line in lines]
  assert len(results) == len(PARTS.split()), (tmp_path / 'log.txt').read_text()
  assert not check_parts.problems(results, dry_run=True)
  parts = {r['part'] for r in results}
  assert parts == {'link', 'opt', 'train', 'profile'}, parts


def _good_rows() -> list[dict]:
  """One usable result of every kind of part, as gpu_parts prints them."""
  opt = {'part': 'opt', 'median_s': 0.2, 'num_params': 10, 'dtype': 'float32'}
  calls = {'custom_calls': ['custom-call(...)']}
  return [
    {'part': 'link', 'd2h_gib_s': 40.0, 'h2d_gib_s': 45.0},
    opt
    | {'case': 'stream', 'resolved': 'stream', 'hlo': calls}
    | {'max_rel_vs_optax': 3e-7},
    opt
    | {'case': 'stream', 'resolved': 'stream', 'hlo': calls}
    | {'dtype': 'bfloat16', 'max_rel_vs_optax': 2e-3},
    opt | {'case': 'optax', 'hlo': {}, 'max_rel_vs_optax': None},
    opt
    | {'case': 'stream+clip', 'resolved': 'stream', 'hlo': calls}
    | {'max_rel_vs_optax': None},
    {'part': 'train', 'case': 'stream', 'layout': 'scan', 'losses': [3, 2]}
    | {'executor': 'stream'},
    {'part': 'profile', 'case': 'stream', 'top': [['t', 'e', 1, 0.1]]},
    {'part': 'capacity', 'case': 'stream', 'search': {'largest': 4}}
    | {'trained': {'losses': [1.0]}},
    {'part': 'train', 'case': 'stream+after-loop', 'layout': 'scan'}
    | {'losses': [3, 2], 'executor': 'stream'},
  ]


def test_check_parts_passes_usable_results():
  assert check_parts.problems(_good_rows(), dry_run=False) == []


@pytest.mark.parametrize(
  'index, change, says',
  [
    (0, {'h2d_gib_s': 0.0}, 'no link rate'),
    (1, {'max_rel_vs_optax': 2e-5}, 'max_rel_vs_optax'),
    (2, {'max_rel_vs_optax': 0.1}, 'max_rel_vs_optax'),
    (1, {'hlo': {'custom_calls': []}}, 'no custom call'),
    (4, {'max_rel_vs_optax': 0.0}, 'nothing to compare with'),
    (5, {'executor': 'ffi'}, 'trained with ffi'),
    (5, {'losses': [3]}, 'fewer than 2 losses'),
    (6, {'top': [['t', 'e']]}, 'no profile rows'),
    (7, {'trained': None}, 'no fitting model'),
    (8, {'executor': 'ffi'}, 'trained with ffi, not stream'),
    (3, {'error': 'RESOURCE_EXHAUSTED'}, 'error RESOURCE_EXHAUSTED'),
    (3, {'dry_run': True}, 'dry_run is True'),
  ],
)
def test_check_parts_names_each_unusable_result(index, change, says):
  rows = _good_rows()
  rows[index] = rows[index] | change
  found = check_parts.problems(rows, dry_run=False)
  assert len(found) == 1 and says in found[0], found


def test_check_parts_command_exits_1_on_a_problem(tmp_path):
  rows = _good_rows()
  path = tmp_path / 'parts.jsonl'
  path.write_text('\n'.join(json.dumps(r) for r in rows))
  assert check_parts.main([str(path)]) == 0
  rows[1]['max_rel_vs_optax'] = 1.0
  path.write_text('\n'.join(json.dumps(r) for r in rows))
  assert check_parts.main([str(path)]) == 1
