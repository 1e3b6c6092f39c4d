"""Converts an Orbax checkpoint between `optax.adamw` and `superoffload.adamw`.

    python -m jax_superoffload.convert_checkpoint SRC DST --to superoffload
    python -m jax_superoffload.convert_checkpoint SRC DST --to optax

SRC is a checkpoint of `{'params': ..., 'opt_state': ...}` (as a loop saves
its parameters and optimizer state with Orbax), or one step of MaxText's
checkpoints (`.../checkpoints/<step>`, holding `items/`: `--layout
maxtext`, chosen by itself). DST, which must not exist, gets the same
checkpoint with the other optimizer's state: the count and moments carried
over exactly, the master weights made from the parameters (to
superoffload) or dropped (to optax). Resume it with the other optimizer
as you would resume your own checkpoint; a MaxText step goes into the new
run's `checkpoints/` folder.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
from collections.abc import Sequence

from jax_superoffload._src.host import executors
from jax_superoffload._src.optim import checkpoint_convert
from jax_superoffload._src.optim.offload import Offload

_ITEMS = 'items'  # The item MaxText's checkpoint manager saves the state as.


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m jax_superoffload.convert_checkpoint',
    description=__doc__.split('\n')[0],
  )
  parser.add_argument('src', type=pathlib.Path, help='the checkpoint read')
  parser.add_argument('dst', type=pathlib.Path, help='the one written (new)')
  parser.add_argument(
    '--to',
    choices=('superoffload', 'optax'),
    required=True,
    help='the optimizer whose layout DST gets',
  )
  parser.add_argument(
    '--layout',
    choices=checkpoint_convert.LAYOUTS,
    default=None,
    help='plain {params, opt_state}, or maxtext (default: maxtext where '
    'SRC holds items/, else plain)',
  )
  parser.add_argument(
    '--executor',
    choices=executors.EXECUTORS,
    default='auto',
    help='to superoffload: the executor of the resuming run (the stream '
    "executor's state holds a digest of the weights)",
  )
  parser.add_argument(
    '--schedule',
    action='store_true',
    help="to optax: the resuming optax.adamw's learning rate is a schedule",
  )
  parser.add_argument(
    '--masked',
    action='store_true',
    help='to optax: the resuming optax.adamw has a weight-decay mask',
  )
  return parser


def main(argv: Sequence[str] | None = None) -> None:
  """Converts SRC into DST (see the module)."""
  args = _parser().parse_args(argv)
  import orbax.checkpoint as ocp

  if args.dst.exists():
    raise SystemExit(f'{args.dst} exists: give a new folder')
  manager_step = (args.src / _ITEMS).is_dir()
  layout = args.layout or ('maxtext' if manager_step else 'plain')
  src = args.src / _ITEMS if manager_step else args.src
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.restore(src.resolve())
  if args.to == 'superoffload':
    offload = Offload(executor=args.executor)
    tree = checkpoint_convert.to_superoffload(tree, layout, offload)
  else:
    tree = checkpoint_convert.to_optax(
      tree, layout, schedule=args.schedule, masked=args.masked
    )
  if manager_step:  # The step's own files (its metadata) beside the item.
    shutil.copytree(args.src, args.dst, ignore=shutil.ignore_patterns(_ITEMS))
  dst = (args.dst / _ITEMS if manager_step else args.dst).resolve()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(dst, tree)
    checkpointer.wait_until_finished()
  print(f'{args.src} ({layout}) -> {args.dst}: {args.to} layout')


if __name__ == '__main__':
  main()
