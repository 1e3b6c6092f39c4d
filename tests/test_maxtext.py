"""MaxText's own pre-train loop, stock and through superoffload's entry.

A tiny synthetic config (`experiments.maxtext.tiny`) runs in child
processes (`experiments.maxtext.run`), each recording its losses, where
each optimizer-state leaf lives after MaxText's init and in its compiled
train step, and which state leaves the step moves to device memory. The
judges: stock MaxText's own losses (fp32: the same AdamW, a few fp32
roundings apart, 1e-5 relative; bf16 compute: bf16's unit roundoff, 2^-8,
relative), the unconverted runs for converted checkpoints, and stock
MaxText with `optimizer_memory_host_offload=true` as the positive control
of the detector of moves to the device (it moves the whole state).

Needs MaxText (`pip install jax_superoffload[maxtext]`, Python 3.12+);
skipped without it, unless JAX_SUPEROFFLOAD_REQUIRE_MAXTEXT=1 (CI's
MaxText stage) makes that a failure.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from experiments.maxtext import tiny

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_REQUIRED = os.environ.get('JAX_SUPEROFFLOAD_REQUIRE_MAXTEXT') == '1'

try:
  import maxtext  # noqa: F401
except ImportError:
  if _REQUIRED:
    raise
  pytest.skip('MaxText is not installed', allow_module_level=True)

from jax_superoffload import convert_checkpoint  # noqa: E402

FP32_RTOL = 1e-5
BF16_RTOL = 2.0**-8
_CHECKPOINTS = {
  'enable_checkpointing': 'true',
  'checkpoint_period': 10,
  'learning_rate_schedule_steps': 20,  # The same schedule for 10 steps.
}


class _Runs:
  """The recorded runs of one output folder, each made once."""

  def __init__(self, folder: pathlib.Path):
    self.folder = folder
    self.done: dict[str, dict] = {}

  def __call__(self, name, optimizer, devices=1, again=False, **overrides):
    """The run `name` (MaxText's run name too); `again`: run it once more."""
    if again or name not in self.done:
      out = self.folder / f'{name}.json'
      args = tiny.overrides(str(self.folder / 'out'), name, **overrides)
      child = subprocess.run(
        [
          sys.executable, '-m', 'experiments.maxtext.run',
          '--optimizer', optimizer, '--devices', str(devices),
          '--out', str(out), '--', tiny.base_config(), *args,
        ],
        cwd=_ROOT, capture_output=True, text=True, timeout=900, check=False,
      )  # fmt: skip
      assert child.returncode == 0, child.stderr[-4000:]
      record = json.loads(out.read_text())
      record['losses'] = {int(k): v for k, v in record['losses'].items()}
      self.done[name] = record
    return self.done[name]

  def checkpoint(self, run: str, step: int) -> pathlib.Path:
    return self.folder / 'out' / run / 'checkpoints' / str(step)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  return _Runs(tmp_path_factory.mktemp('maxtext'))


def _ours_of(kinds: dict) -> dict:
  return {p: k for p, k in kinds.items() if any(
    f'{n}' in p for n in ("'mu'", '.mu', "'nu'", '.nu', 'master')
  )}  # fmt: skip


def _assert_state_on_host(record):
  for when in ('init_memory', 'step_memory'):
    ours = _ours_of(record[when])
    # mu, nu and master of each of the tiny model's 12 parameters.
    assert len(ours) == 36, (when, sorted(record[when]))
    assert set(ours.values()) == {'pinned_host'}, (when, ours)
  moved = [m for m in record['state_to_device'] if m['shape']]
  assert not moved, moved


def _assert_losses_near(got, want, rtol, steps=range(20)):
  assert sorted(got['losses']) == list(steps)
  for step in steps:
    a, b = got['losses'][step], want['losses'][step]
    assert abs(a - b) <= rtol * abs(b), (step, a, b)


def test_superoffload_trains_as_stock_with_its_state_on_the_host(runs):
  stock = runs('stock', 'stock', **_CHECKPOINTS)
  ours = runs('ours', 'superoffload', **_CHECKPOINTS)
  _assert_losses_near(ours, stock, FP32_RTOL)
  _assert_state_on_host(ours)
  assert set(stock['init_memory'].values()) == {'device'}  # MaxText's own.


def test_maxtexts_host_offload_flag_moves_stock_state_but_not_ours(runs):
  flag = {'optimizer_memory_host_offload': 'true'}
  stock = runs('stock_flag', 'stock', **flag)
  ours = runs('ours_flag', 'superoffload', **flag)
  # The detector's positive control: stock's flag moves its moments in.
  assert len([m for m in stock['state_to_device'] if m['shape']]) >= 24
  _assert_state_on_host(ours)
  _assert_losses_near(ours, runs('stock', 'stock', **_CHECKPOINTS), FP32_RTOL)


def test_fsdp_on_two_devices_with_no_extra_argument(runs):
  stock = runs('stock_fsdp', 'stock', devices=2, ici_fsdp_parallelism=2)
  ours = runs('ours_fsdp', 'superoffload', devices=2, ici_fsdp_parallelism=2)
  _assert_losses_near(ours, stock, FP32_RTOL)
  _assert_state_on_host(ours)
  # Each shard stepped where it lives: no collective beyond stock's (the
  # state gathered around the host step would add all-gathers).
  assert ours['step_collectives'] == stock['step_collectives']


def test_bf16_compute_trains_as_stock(runs):
  stock = runs('stock_bf16', 'stock', dtype='bfloat16')
  ours = runs('ours_bf16', 'superoffload', dtype='bfloat16')
  _assert_losses_near(ours, stock, BF16_RTOL)


def test_a_resumed_run_continues_exactly(runs):
  whole = runs('ours', 'superoffload', **_CHECKPOINTS)
  runs('ours_10', 'superoffload', steps=10, **_CHECKPOINTS)
  # The same run name: MaxText resumes from its checkpoint of step 9.
  again = runs('ours_10', 'superoffload', again=True, **_CHECKPOINTS)
  assert sorted(again['losses']) == list(range(10, 20))
  for step in range(10, 20):
    assert again['losses'][step] == whole['losses'][step], step
  assert set(_ours_of(again['init_memory']).values()) == {'pinned_host'}


@pytest.mark.parametrize(
  ('source', 'to', 'resumer'),
  [('stock', 'superoffload', 'superoffload'), ('ours', 'optax', 'stock')],
)
def test_a_converted_checkpoint_resumes_as_the_unconverted_run(
  runs, source, to, resumer
):
  optimizer = 'stock' if source == 'stock' else 'superoffload'
  whole = runs(source, optimizer, **_CHECKPOINTS)
  runs(f'{source}_half', optimizer, steps=10, **_CHECKPOINTS)
  name = f'{source}_to_{to}'
  target = runs.checkpoint(name, 9)
  shutil.rmtree(target.parent.parent, ignore_errors=True)
  target.parent.mkdir(parents=True)
  convert_checkpoint.main(
    [str(runs.checkpoint(f'{source}_half', 9)), str(target), '--to', to]
  )
  resumed = runs(name, resumer, **_CHECKPOINTS)
  _assert_losses_near(resumed, whole, FP32_RTOL, range(10, 20))


def test_the_module_command_runs_maxtexts_main(tmp_path):
  # As a user runs it: MaxText's own main, through the entry.
  args = tiny.overrides(str(tmp_path), 'command', steps=3)
  child = subprocess.run(
    [
      sys.executable, '-m', 'jax_superoffload.integrations.maxtext',
      tiny.base_config(), *args,
    ],
    cwd=_ROOT, capture_output=True, text=True, timeout=900, check=False,
    env={
      **os.environ,
      'XLA_FLAGS': '--xla_force_host_platform_device_count=1',
    },
  )  # fmt: skip
  assert child.returncode == 0, child.stderr[-4000:]
  assert 'completed step: 2' in child.stdout + child.stderr
