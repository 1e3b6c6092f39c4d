"""Writes the fixture of a Flax NNX checkpoint of the old state layout.

Run with the code BEFORE the optax-shaped state layout (main at 1182c2a, whose
`SuperOffloadState` was one flat NamedTuple), from the repository root:

  PYTHONPATH=$PWD python tests/data/make_legacy_nnx_ckpt.py tests/data

It saves `nnx.state((model, optimizer))` of `make_legacy_trainer_ckpt`'s
model and optimizer after two steps with Orbax's StandardCheckpointer into
`legacy_nnx_ckpt/`, and the parameters one step later, computed by that
same old code, into `legacy_nnx_next_params.npz`.
"""

import pathlib
import sys

import orbax.checkpoint as ocp
from flax import nnx
from make_legacy_trainer_ckpt import build
from make_legacy_trainer_ckpt import save_params
from make_legacy_trainer_ckpt import step


def main(folder: pathlib.Path) -> None:
  model, optimizer = build()
  for k in range(2):
    step(model, optimizer, k)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(folder / 'legacy_nnx_ckpt', nnx.state((model, optimizer)))
  ckptr.wait_until_finished()
  step(model, optimizer, 2)
  save_params(model, folder / 'legacy_nnx_next_params.npz')


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]).resolve())
