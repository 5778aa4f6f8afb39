"""The failure detector: rank 0 and every other rank show each other they are alive; silence is a lost rank.

TCP notices a host that was cut off only after minutes, and a frozen process (SIGSTOP, a host that swaps)
never; the stall watch only notices once pending work stops moving, which a live input never lets happen.
So, as Flink's JobManager and TaskManagers do, every rank sends rank 0 a heartbeat once per `interval` and
rank 0 sends each of them one; a peer silent for `cluster.heartbeat_timeout` is lost.  Rank 0 then ends the
job naming the rank, its host and what was last heard from it; any other rank that no longer hears rank 0
exits by itself, so nothing stays running on a host that was cut off.

The heartbeats travel on a communicator of their own, sent and received by a thread of their own: the rank's
own loops never see them, and a rank busy joining a long batch still beats.  `Liveness` is the detector's
state (pure: it takes the time and returns whom to beat and who is lost); `Heartbeats` its thread.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable

import numpy as np

from protocol.lifetime import CRASH, LOST

if TYPE_CHECKING:
    from protocol.plan import Plan

TAG_HEARTBEAT = 1  #: on the heartbeat communicator: an int64 message, its sender's count of heartbeats
#: at most this share of the timeout between two heartbeats, so a few may be late before a peer counts as lost
BEATS_PER_TIMEOUT = 5
#: a rank gives rank 0 this much longer than rank 0 gives it: when a link between them is cut both fall
#: silent at once, and rank 0, which can name what it lost and what it last heard, must speak first
PATIENCE = 1.5


def heartbeat_interval(timeout: float, epoch: float) -> float:
    """A heartbeat at least once per distribution epoch and BEATS_PER_TIMEOUT times per timeout."""
    return min(epoch, timeout / BEATS_PER_TIMEOUT)


class Liveness:
    """Whom to send a heartbeat and who is lost, from when each peer was last heard and last sent to."""

    def __init__(self, peers, timeout: float, interval: float, now: float):
        self.timeout, self.interval = timeout, interval
        self.heard = {p: now for p in peers}  #: peer -> when anything was last heard from it
        self.sent = {p: -np.inf for p in peers}  #: peer -> when it was last sent a heartbeat
        self.checked = now  #: when `lost` last looked

    def on_heard(self, peer: int, now: float) -> None:
        if peer in self.heard:
            self.heard[peer] = now

    def due(self, now: float) -> list[int]:
        """Peers owed a heartbeat now (each is then counted as sent to)."""
        due = [p for p, t in self.sent.items() if now - t >= self.interval]
        for p in due:
            self.sent[p] = now
        return due

    def lost(self, now: float) -> list[tuple[int, float]]:
        """(peer, seconds silent) of every watched peer silent for longer than the timeout.  None if this
        process itself stood still (SIGSTOP, a swapping host) for half the timeout since it last looked: the
        silence was its own, so every peer counts as heard now and gets a full timeout again."""
        stood_still, self.checked = now - self.checked > self.timeout / 2, now
        if stood_still:
            self.heard = dict.fromkeys(self.heard, now)
            return []
        return [(p, now - t) for p, t in self.heard.items() if now - t > self.timeout]

    def forget(self, peer: int) -> None:
        """`peer` has ended its part of the run (its final report came): it is no longer watched or beaten."""
        self.heard.pop(peer, None)
        self.sent.pop(peer, None)


def role_of(rank: int, dispatchers: int) -> str:
    return "master" if rank == 0 else "dispatcher" if rank < dispatchers else "slave"


class Heartbeats:
    """The thread that sends and receives heartbeats on its own communicator and acts on a lost peer.

    `comm` is duplicated here: a collective, so every rank of the job creates this at the same point (after the
    start barrier, when each is there already).  Rank 0 watches every other rank, the others watch rank 0.
    `about(rank)`: what rank 0 last heard from a peer besides heartbeats (its last report), for the message."""

    def __init__(
        self,
        comm,
        hosts: list[str],
        dispatchers: int,
        timeout: float,
        interval: float,
        about: Callable[[int], str] = lambda rank: "",
    ):
        self.comm = comm.Dup()
        self.rank, self.hosts, self.dispatchers = comm.rank, hosts, dispatchers
        self.about = about
        peers = range(1, comm.size) if comm.rank == 0 else [0]
        self.started = time.monotonic()
        self.state = Liveness(peers, timeout * (1 if comm.rank == 0 else PATIENCE), interval, self.started)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beats = 0
        self._inbox = np.zeros(1, dtype=np.int64)
        self._sending: list = []  #: (request, buffer) of heartbeats on their way
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def name(self, rank: int) -> str:
        return f"rank {rank} ({role_of(rank, self.dispatchers)}, host {self.hosts[rank]})"

    def forget(self, peer: int) -> None:
        with self._lock:
            self.state.forget(peer)

    def _run(self) -> None:
        """The thread: a failure in it is a bug that ends the job, as one on the rank's main thread does."""
        try:
            self._beat()
        except Exception as error:  # noqa: BLE001
            print(
                f"error: {self.name(self.rank)}: the heartbeat thread failed: {type(error).__name__}: {error}; "
                "aborting the job",
                file=sys.stderr,
                flush=True,
            )
            traceback.print_exc()
            self.comm.Abort(CRASH)

    def _beat(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while not self._stop.wait(self.state.interval / 2):
            now = time.monotonic()
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HEARTBEAT, status=status):
                self.comm.Recv(self._inbox, source=status.Get_source(), tag=TAG_HEARTBEAT)
                with self._lock:
                    self.state.on_heard(status.Get_source(), now)
            self._sending = [(r, b) for r, b in self._sending if not r.Test()]
            with self._lock:
                due, lost = self.state.due(now), self.state.lost(now)
            self._beats += 1
            for peer in due:
                beat = np.array([self._beats], dtype=np.int64)
                self._sending.append((self.comm.Isend(beat, dest=peer, tag=TAG_HEARTBEAT), beat))
            if lost:
                self._lost(lost, now)
                return

    def _lost(self, lost: list[tuple[int, float]], now: float) -> None:
        """Rank 0: end the job (MPI_Abort with LOST), naming every peer lost; another rank: exit, rank 0 is
        gone or cut off."""
        since = f"{now - self.started:.1f}s after the start; heartbeat_timeout {self.state.timeout:g}s"
        if self.rank == 0:
            peer, silent = lost[0]
            more = self.about(peer)
            silent_hosts = {self.hosts[p] for p, _ in lost}
            others = {self.hosts[p] for p in self.state.heard} - {self.hosts[0]}
            also = f"; also silent: {', '.join(self.name(p) for p, _ in lost[1:])}" if len(lost) > 1 else ""
            alone = (
                f"; every other host ({', '.join(sorted(others))}) is silent: this host ({self.hosts[0]}) may "
                "be the one cut off"
                if len(others) > 1 and others <= silent_hosts
                else ""
            )
            print(
                f"error: {self.name(peer)} is lost: nothing heard from it for {silent:.1f}s ({since})"
                f"{'; ' + more if more else ''}{also}{alone}: its process or host is gone, frozen or cut off; "
                "ending the job",
                file=sys.stderr,
                flush=True,
            )
            self.comm.Abort(LOST)
        else:
            print(
                f"error: {self.name(self.rank)}: nothing heard from {self.name(0)} for {lost[0][1]:.1f}s "
                f"({since}): it or its host is lost; exiting",
                file=sys.stderr,
                flush=True,
            )
            end_local_daemon()
        os._exit(LOST)

    def stop(self, grace: float | None = None) -> None:
        """Stop beating (before MPI_Finalize: no other thread may call MPI then).  `grace`: seconds this
        process may still take to end (MPI_Finalize waits for every rank): past them it exits with LOST,
        so a rank whose peers vanished during the last steps does not hang."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if grace is not None:
            timer = threading.Timer(grace, self._overdue, args=(grace,))
            timer.daemon = True
            timer.start()

    def _overdue(self, grace: float) -> None:
        print(
            f"error: {self.name(self.rank)}: the job did not end within {grace:g}s of this rank's last step "
            "(a rank or host is lost at the end); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(LOST)


def end_local_daemon() -> None:
    """The job is over once rank 0 is lost: end this host's Open MPI daemon (prted: this rank's parent and its
    parent, the daemon forks once) and with it the ranks it started here.  Cut off from mpirun, it would
    otherwise wait for its link for as long as TCP retransmits what it was sending (15 minutes on Linux), and
    a SIGTERM alone sometimes leaves it waiting to report.  Any other parent (mpirun itself on the launching
    host, a batch system's step daemon) is left alone."""
    import psutil

    daemons, p = [], psutil.Process().parent()
    while p is not None and p.name() == "prted":
        daemons.append(p)
        p = p.parent()
    for d in daemons:
        d.terminate()
    for d in psutil.wait_procs(daemons, timeout=2.0)[1]:
        d.kill()


_current: Heartbeats | None = None  #: this process's heartbeats, once the start barrier is passed


def start(comm, hosts: list[str], plan: Plan, about: Callable[[int], str]) -> None:
    """Start this rank's heartbeats (every rank at once: the communicator is duplicated); they stop before
    MPI_Finalize, which runs at exit."""
    global _current
    timeout = plan.cluster.heartbeat_timeout
    _current = Heartbeats(
        comm, hosts, plan.cluster.dispatchers, timeout, heartbeat_interval(timeout, plan.epochs.distribution), about
    )
    atexit.register(stop)


def stop(grace: float | None = None) -> None:
    """Stop this rank's heartbeats, if they run (`Heartbeats.stop`)."""
    global _current
    if _current is not None:
        _current.stop(grace)
        _current = None


def forget(peer: int) -> None:
    """Rank 0: `peer` has sent its last word (its final report or summary) and is no longer watched."""
    if _current is not None:
        _current.forget(peer)
