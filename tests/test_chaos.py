"""Chaos: one process of a 2- or 3-process run dies; the others end cleanly.

Each case is one round of `experiments.trainer.chaos` (see there for what
is checked): the survivors exit with 4 and print one line and nothing from
jax, XLA or Gloo, no process is left behind, the newest committed
checkpoint resumes, and the resumed losses equal an uninterrupted run's bit
for bit. The cases cover process 0 (the coordinator) and another, at
start-up, mid-step and mid-save, by kill -9, SIGTERM, an exception and a
hang. ``python -m experiments.trainer.chaos --rounds N`` runs random ones.
"""

import pytest

from experiments.trainer import chaos

_CASES = [
  # processes, victim, moment, how, when
  '2,0,step,kill9,3',  # The coordinator, mid-step (the known crash).
  '2,1,save,term,4',
  '3,0,save,kill9,8',
  '3,2,startup,exception,1',
  '3,1,step,hang,4',
]


@pytest.fixture(scope='module')
def work(tmp_path_factory):
  """A folder per module, with the compilation cache all rounds share."""
  return tmp_path_factory.mktemp('chaos')


@pytest.fixture(scope='module')
def references(work):
  """Losses of an uninterrupted run per process count, computed once."""
  env = chaos.child_env(work / 'cache')
  found = {}

  def losses(n: int) -> list[float]:
    if n not in found:
      found[n] = chaos.reference(n, work / f'ref{n}', env)
      assert len(found[n]) == chaos.STEPS
    return found[n]

  return losses


@pytest.mark.parametrize('case', _CASES)
def test_a_death_ends_the_others_cleanly(case, work, references, tmp_path):
  r = chaos.Round.parse(case)
  env = chaos.child_env(work / 'cache')
  failures, took = chaos.run_round(r, tmp_path, env, references(r.n))
  assert not failures, failures
  bound = chaos.GRACE_S + (chaos.HEARTBEAT_S if r.kind == 'hang' else 0)
  assert took < bound


def _flip_bytes(path) -> None:
  data = bytearray(path.read_bytes())
  for i in range(len(data) // 3, min(len(data), len(data) // 3 + 400)):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _cut_short(path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize('damage', [_flip_bytes, _cut_short])
def test_a_shard_damaged_on_one_process_is_rejected_by_all(
  damage, work, tmp_path
):
  """Process 1's shards of the newest step are damaged: both skip it.

  Each process reads and digests only its own shards (ZeRO puts half of the
  optimizer state on each), so only process 1 sees the damage; the vote
  makes both resume from the step before. Flipped bytes may still decode
  (the digest catches them) or fail the read; a file cut short always
  fails it, on process 1 alone, before any barrier the others wait in.
  """
  env = chaos.child_env(work / 'cache')
  args = chaos.train_args(2, tmp_path)
  done = chaos.Job(2, args, tmp_path, 'full', env)
  assert done.wait(chaos.LAUNCH_S) == [0, 0], done.out(0)[-3000:]
  steps = chaos.committed_steps(tmp_path)
  assert steps[-2:] == [chaos.STEPS - chaos.EVERY, chaos.STEPS]
  shards = tmp_path / 'ckpt' / str(chaos.STEPS) / 'state' / 'ocdbt.process_1'
  damage(max(shards.rglob('d/*'), key=lambda p: p.stat().st_size))

  more = [*args, '--config.resume', f'--config.steps={chaos.STEPS + 2}']
  job = chaos.Job(2, more, tmp_path, 'resume', env)
  assert job.wait(chaos.LAUNCH_S) == [0, 0], job.out(0)[-3000:]
  before = chaos.STEPS - chaos.EVERY
  for i in range(2):
    assert f'at step {before}' in job.out(i), job.out(i)[-2000:]
  assert f'step {chaos.STEPS}: ' in job.out(0)  # The damage, named.
  assert 'set aside' in job.out(0)
