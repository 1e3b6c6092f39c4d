"""The prepared GPU command's dry run (issue 25): every kind of part, tiny.

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

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = (
  'link opt:stream opt:stream:bfloat16 opt:stream+stv opt:stream+clip '
  'train:stream:noscan:4 profile:stream'
)


@pytest.mark.dry_run
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
  by = {(r['part'], r.get('case'), r.get('dtype')): r for r in results}
  assert all(r['dry_run'] for r in results)
  link = by[('link', None, None)]
  assert link['d2h_gib_s'] > 0 and link['h2d_gib_s'] > 0
  for case in ('stream', 'stream+stv'):
    r = by[('opt', case, 'float32')]
    assert r['median_s'] > 0 and r['num_params'] > 0
    # The same steps as optax.adamw: fp32 rounding apart.
    assert r['max_rel_vs_optax'] < 1e-5, r
    assert r['hlo']['custom_calls'], r
  bf16 = by[('opt', 'stream', 'bfloat16')]
  assert bf16['max_rel_vs_optax'] < 2**-6, bf16  # bf16 weights' rounding.
  assert by[('opt', 'stream+clip', 'float32')]['max_rel_vs_optax'] is None
  train = next(r for r in results if r['part'] == 'train')
  assert train['layout'] == 'noscan' and len(train['losses']) >= 2
  assert train['executor'] == 'stream'
  top = by[('profile', 'stream', None)]['top']
  assert top and all(len(row) == 4 for row in top)
