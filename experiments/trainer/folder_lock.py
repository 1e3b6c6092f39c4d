"""One writer per checkpoint folder: an advisory lock that names its owner.

`FolderLock` takes a `fcntl.flock` on ``<folder>/.lock`` and writes the
owner's PID, host and start time into it. The kernel drops the lock when its
owner dies, however it dies, so a lock file left by a dead process is simply
taken over; a second live trainer is refused with the owner in the message.
"""

import datetime
import fcntl
import json
import os
import pathlib
import socket
from typing import Any

from experiments.trainer import config as config_lib


class FolderLock:
  """An exclusive, advisory lock on a folder: one trainer writes it at a time.

  The lock is a `fcntl.flock` on ``<folder>/.lock``, so the kernel drops it
  when its owner dies, however it dies; the file names the owner's PID,
  host and start time for the message a second trainer gets. A lock file
  left by a dead process is taken over.
  """

  FILE = '.lock'

  def __init__(self, directory: str | pathlib.Path):
    """Prepares (does not take) the lock of `directory`."""
    self.directory = pathlib.Path(directory)
    self.path = self.directory / self.FILE
    self._fd: int | None = None

  def acquire(self) -> str | None:
    """Takes the lock, creating the folder if needed.

    Returns:
      A one-line note when a stale lock of a dead process was taken over,
      else None.

    Raises:
      config_lib.ConfigError: If the folder is not writable or another live
        trainer holds the lock.
    """
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise config_lib.ConfigError(
        f'checkpoint folder {self.directory} is not writable: {e}'
      ) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      owner = _read_owner(fd)
      os.close(fd)
      raise config_lib.ConfigError(self._busy(owner)) from None
    previous = _read_owner(fd)
    if _alive_elsewhere(previous):
      # Same host, live process, yet flock was free: a file system whose
      # locks are not shared (some network mounts). Trust the PID.
      os.close(fd)
      raise config_lib.ConfigError(self._busy(previous))
    owner = {
      'pid': os.getpid(),
      'host': socket.gethostname(),
      'since': datetime.datetime.now().isoformat(timespec='seconds'),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(owner) + '\n').encode(), 0)
    self._fd = fd
    if previous.get('pid') is not None:
      return (
        f'note: took over the stale lock of process {previous["pid"]} on '
        f'{previous.get("host")} (no longer running) in {self.directory}'
      )
    return None

  def _busy(self, owner: dict[str, Any]) -> str:
    return (
      f'checkpoint folder {self.directory} is in use by another trainer '
      f'(PID {owner.get("pid", "?")} on {owner.get("host", "?")}, since '
      f'{owner.get("since", "?")}); wait for it to finish or choose another '
      '--checkpoint-dir'
    )

  def release(self) -> None:
    """Removes the lock file and drops the lock (idempotent)."""
    if self._fd is None:
      return
    self.path.unlink(missing_ok=True)
    os.close(self._fd)  # Drops the flock.
    self._fd = None


def _read_owner(fd: int) -> dict[str, Any]:
  """The owner a lock file names, or {} when it is empty or unreadable."""
  try:
    data = json.loads(os.pread(fd, 4096, 0).decode() or '{}')
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


def _alive_elsewhere(owner: dict[str, Any]) -> bool:
  """Whether `owner` is another live process on this host."""
  pid = owner.get('pid')
  if not isinstance(pid, int) or pid == os.getpid():
    return False
  if owner.get('host') != socket.gethostname():
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Exists, owned by another user.
    pass
  return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
  """Whether `pid` has exited but not been reaped (Linux; else False)."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except OSError:
    return False
  # The state follows the parenthesised command name, which may hold spaces.
  return stat.rsplit(')', 1)[-1].split()[:1] == ['Z']
