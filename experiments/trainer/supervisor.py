"""The process a user starts for one rank of a multi-process run.

A trainer process of a `jax.distributed` run holds three parts that react
when a peer dies: the trainer's own checks, Gloo (an exception in the step)
and jax's coordination client, which aborts the process (``client.h``:
"Terminating process because the JAX distributed service detected fatal
errors", SIGABRT) and whose error callback cannot be set from Python (the
client calls it with an ``absl::Status`` that nanobind cannot convert:
``std::bad_cast``, then SIGABRT, on jax 0.10.2 and 0.12.0.1). Whichever
acts first decides the exit status and the output, so the outcome varies
from run to run.

So ``python -m experiments.trainer --coordinator ...`` starts no trainer in
its own process: `supervise` runs the trainer as a child and owns what the
user sees, which none of those parts can reach:

* the watchdog: one TCP connection from every rank's supervisor to rank 0's
  (set up through the child, which reads the address from jax's key-value
  store), with a heartbeat line every `bound_s` / 4 seconds. End-of-file
  without a goodbye is a death (the kernel closes a dead process's sockets,
  kill -9 included), silence for `bound_s` is a hang;
* the exit status: 4 (`LOST_EXIT`) after a peer's loss, whatever the child
  did meanwhile (it is killed); else the child's own status;
* stderr: the child's stderr reaches the terminal `HOLD_S` seconds late,
  and after a loss what is still held (the noise of the last moments: a
  Gloo traceback, XLA log lines, an abort) is dropped and one line is
  printed instead.

The supervisor imports nothing heavy (no jax), so it starts at once.
"""

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any

# Exit status of a process whose peer was lost.
LOST_EXIT = 4
# In the child: the file descriptor of its link to the supervisor.
LINK_ENV = 'EXPERIMENTS_TRAINER_SUPERVISOR_FD'
# Seconds the child's stderr is held before it reaches the terminal.
HOLD_S = 1.0
# Seconds an unclean exit of the child waits for a peer's loss to show.
SETTLE_S = 5.0
_TICK_S = 0.05
# Test-only: SIGUSR1 raises an exception in the trainer's main thread (the
# supervisor ignores it, so that it can be sent to the process group).
RAISE_ENV = 'EXPERIMENTS_TEST_RAISE_ON_SIGUSR1'


class _Peer:
  """A watchdog connection to another rank's supervisor."""

  def __init__(self, conn: socket.socket, rank: int | None):
    self.conn, self.rank = conn, rank
    self.buffer = b''
    self.seen = time.monotonic()


class Supervisor:
  """Runs one trainer child; see the module docstring."""

  def __init__(self, argv: list[str], bound_s: float):
    self.bound_s = bound_s
    self.rank: int | None = None
    self.size: int | None = None
    self.coordinator: str | None = None
    self.peers: list[_Peer] = []
    self.expected = 0  # Peers rank 0 still waits for.
    self.accept_by = 0.0
    self.server: socket.socket | None = None
    self.held: list[tuple[float, bytes]] = []
    self.clean = False  # The child said goodbye (its run is settled).
    self.child_seen = time.monotonic()
    self.sel = selectors.DefaultSelector()
    parent, child = socket.socketpair()
    self.link = parent
    self.link_buffer = b''
    self.child = subprocess.Popen(
      [sys.executable, '-m', 'experiments.trainer', *argv],
      env={**os.environ, LINK_ENV: str(child.fileno())},
      pass_fds=(child.fileno(),),
      stderr=subprocess.PIPE,
    )
    child.close()
    self.sel.register(self.link, selectors.EVENT_READ, self._on_link)
    self.sel.register(self.child.stderr, selectors.EVENT_READ, self._on_err)

  # Output.

  def _on_err(self, pipe: Any) -> None:
    data = os.read(pipe.fileno(), 1 << 16)
    if not data:
      self.sel.unregister(pipe)
      return
    self.held.append((time.monotonic(), data))

  def _forward(self, everything: bool = False) -> None:
    limit = time.monotonic() - HOLD_S
    while self.held and (everything or self.held[0][0] <= limit):
      _write_all(2, self.held.pop(0)[1])

  def _drain(self) -> None:
    """Reads what the child's stderr still holds (the child has ended)."""
    try:
      self.sel.get_key(self.child.stderr)
    except KeyError:
      return  # Already at its end.
    fd = self.child.stderr.fileno()
    os.set_blocking(fd, False)
    try:
      while data := os.read(fd, 1 << 16):
        self.held.append((time.monotonic(), data))
    except OSError:  # Nothing more now (a grandchild may hold it open).
      pass

  def stop(self, line: str, status: int, drop: bool = True) -> None:
    """Ends the child, prints `line` (dropping held noise), exits."""
    if self.child.poll() is None:
      self.child.kill()
    if drop:
      self.held = []
    else:
      self._drain()
      self._forward(everything=True)
    for peer in self.peers:  # No goodbye: the peers stop too.
      peer.conn.close()
    _write_all(2, (line + '\n').encode())
    self.child.wait()
    os._exit(status)

  def lost(self, rank: Any, why: str) -> None:
    """A peer is gone: tell the others (rank 0 relays), stop with 4."""
    for peer in self.peers:
      with contextlib.suppress(OSError):
        peer.conn.sendall(f'lost {rank} {why}\n'.encode())
    self.stop(
      f'error: lost process {rank} of {self.size or "?"} ({why}); process '
      f'{self._me()} stops',
      LOST_EXIT,
    )

  def _me(self) -> str:
    return '?' if self.rank is None else str(self.rank)

  # The child's link.

  def _on_link(self, link: socket.socket) -> None:
    try:
      data = link.recv(4096)
    except OSError:
      data = b''
    if not data:
      self.sel.unregister(link)
      self._child_ended()
      return
    self.child_seen = time.monotonic()
    self.link_buffer += data
    while b'\n' in self.link_buffer:
      line, self.link_buffer = self.link_buffer.split(b'\n', 1)
      self._command(line.decode().split())

  def _command(self, words: list[str]) -> None:
    if words[0] == 'hello':
      self.rank, self.size = int(words[1]), int(words[2])
      self.coordinator = words[3]
    elif words[0] == 'listen':
      self._listen(words[1])
    elif words[0] == 'connect':
      self._connect(words[1])
    elif words[0] == 'bye':
      self.clean = True

  def _listen(self, host: str) -> None:
    self.server = socket.create_server((host, 0))
    self.server.setblocking(False)
    self.expected = (self.size or 1) - 1
    self.accept_by = time.monotonic() + self.bound_s
    self.sel.register(self.server, selectors.EVENT_READ, self._on_accept)
    self.link.sendall(f'port {self.server.getsockname()[1]}\n'.encode())

  def _connect(self, address: str) -> None:
    where, port = address.rsplit(':', 1)
    try:
      conn = socket.create_connection((where, int(port)), self.bound_s)
      conn.sendall(f'{self.rank}\n'.encode())
    except OSError as e:
      self.lost(0, f'its watchdog at {address} is unreachable: {e}')
      return
    self._add_peer(conn, 0)
    self.link.sendall(b'connected\n')

  def _on_accept(self, server: socket.socket) -> None:
    conn, _ = server.accept()
    self._add_peer(conn, None)
    self.expected -= 1
    if not self.expected:
      self.sel.unregister(server)
      server.close()
      self.server = None

  def _add_peer(self, conn: socket.socket, rank: int | None) -> None:
    conn.setblocking(False)
    peer = _Peer(conn, rank)
    self.peers.append(peer)
    self.sel.register(conn, selectors.EVENT_READ, lambda c: self._on_peer(peer))

  # Peers.

  def _on_peer(self, peer: _Peer) -> None:
    try:
      data = peer.conn.recv(4096)
    except OSError:
      data = b''
    if not data:
      self._peer_closed(peer)
      return
    peer.seen = time.monotonic()
    peer.buffer += data
    while b'\n' in peer.buffer:
      line, peer.buffer = peer.buffer.split(b'\n', 1)
      words = line.decode().split(maxsplit=2)
      if peer.rank is None:  # The first line names the peer.
        peer.rank = int(words[0])
      elif words[0] == 'bye':
        peer.rank = ('bye', peer.rank)
      elif words[0] == 'lost':
        self.lost(words[1], words[2] if len(words) > 2 else 'reported')

  def _peer_closed(self, peer: _Peer) -> None:
    self.sel.unregister(peer.conn)
    self.peers.remove(peer)
    if isinstance(peer.rank, tuple) or self.clean:
      return  # A goodbye, or our own run is settled.
    self.lost(
      peer.rank,
      f'its connection to process {self._me()} closed without a clean exit',
    )

  def _tick(self, now: float, beat_due: bool) -> None:
    for peer in list(self.peers):
      if beat_due:
        with contextlib.suppress(OSError):  # Its reader sees a loss.
          peer.conn.sendall(b'beat\n')
      if now - peer.seen > self.bound_s and not self.clean:
        self.lost(peer.rank, f'no heartbeat for {self.bound_s:g} s: hung')
    if self.server is not None and now > self.accept_by:
      self.lost(
        '?',
        f'{self.expected} process(es) did not connect within '
        f'{self.bound_s:g} s',
      )
    hung = now - self.child_seen > self.bound_s
    if self.rank is not None and hung and self.child.poll() is None:
      self.stop(
        f'error: process {self._me()} hung (no sign of life for '
        f'{self.bound_s:g} s); it stops',
        LOST_EXIT,
        drop=False,
      )

  # The child's end.

  def _child_ended(self) -> None:
    status = self.child.wait()
    code = 128 - status if status < 0 else status
    if not self.clean and self.rank is not None:
      # A loss may be why the child died: give it time to show (`lost`
      # exits); a peer that never connected shows by the accept deadline.
      now = time.monotonic()
      deadline = now + max(SETTLE_S, self.accept_by - now)
      while time.monotonic() < deadline:
        self._serve(_TICK_S)
        self._tick(time.monotonic(), False)
      if self.rank != 0 and self._coordinator_gone():
        self.lost(0, 'the coordinator no longer answers')
    self._drain()
    self._forward(everything=True)
    for peer in self.peers:
      if self.clean:
        with contextlib.suppress(OSError):
          peer.conn.sendall(b'bye\n')
      peer.conn.close()
    os._exit(code)

  def _coordinator_gone(self) -> bool:
    if not self.coordinator or ':' not in self.coordinator:
      return False
    host, port = self.coordinator.rsplit(':', 1)
    try:
      socket.create_connection((host.strip('[]'), int(port)), 2).close()
    except OSError:
      return True
    return False

  def _serve(self, timeout: float) -> None:
    for key, _ in self.sel.select(timeout):
      key.data(key.fileobj)

  def run(self) -> None:
    """Serves until the child ends or a peer is lost (never returns)."""
    next_beat = 0.0
    while True:
      self._serve(_TICK_S)
      now = time.monotonic()
      beat_due = now >= next_beat
      if beat_due:
        next_beat = now + max(0.05, self.bound_s / 4)
      self._tick(now, beat_due)
      self._forward()


def _write_all(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data) :]


def supervise(argv: list[str], bound_s: float) -> int:
  """Runs the trainer with `argv` as a supervised child (never returns)."""
  if os.environ.get(RAISE_ENV):
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
  sup = Supervisor(argv, bound_s)

  def on_signal(signum: int, frame: Any) -> None:
    del frame
    sup.stop(
      f'error: {signal.Signals(signum).name}: process {sup._me()} of '
      f'{sup.size or "?"} stops at once, without saving (its peers stop '
      'too; --resume continues from the last checkpoint)',
      128 + signum,
    )

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, on_signal)
  sup.run()
  return 0
