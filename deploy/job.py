"""Running mpirun to its end: stop signals, Open MPI's reports read as they come, an abort that really ends.

`JobWatch` reads what Open MPI prints (pure: lines in, facts out): the code a
rank aborted with, a rank that died of a signal, a launch that failed.
`run_job` runs mpirun in its own session with its stderr passed through the
watch, and makes sure the job ends:

* the first SIGINT/SIGTERM/SIGUSR1 becomes the clean stop (SIGUSR1, which
  mpirun forwards to every rank: the master stops ingesting, joins what it
  accepted, flushes and writes the summary); a second aborts (SIGTERM to
  mpirun), and if mpirun is still there ABORT_GRACE seconds later, SIGKILL;
* after a rank's MPI_Abort, mpirun waits for the daemons of every host, a host
  that was cut off included: if it has not ended within ABORT_GRACE seconds it
  is killed with every local rank (they die with it: protocol.lifetime), and
  the ranks on other hosts exit by themselves once they stop hearing rank 0
  (protocol.liveness);
* the exit code is always one of the documented ones (protocol.lifetime.CODES,
  or 128 + N when this launcher was ended by a second signal): Open MPI's own
  codes (14 for a socket closed under a rank, 255 for a daemon that did not
  start, ...) are mapped to them, with one line saying so.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

from protocol.lifetime import CODES, CRASH, LOST, START_FAILED, die_with_parent, exit_code

ABORT_GRACE = 1.5  #: seconds mpirun may take to end after an abort or a second stop signal (it takes well under 1)

_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+).*?(?:Errorcode:|with errorcode)\s*(-?\d+)", re.S)
_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_DAEMON = re.compile(r"lost communication with a remote daemon.*?Remote daemon:\s*\S+ on node (\S+)", re.S)
_NO_DAEMON = re.compile(r"daemon failed to report back.*?Remote host:\s*(\S+)", re.S)
_EXITED = re.compile(r"exited with non-zero status.*?Process name: \S+?(\d+)\]\s*Exit code:\s*(\d+)", re.S)
#: Open MPI's words for a job that never got its ranks running on some host
_LAUNCH = (
    "daemon failed to report back",
    "prte daemon",
    "orte daemon",
    "ssh: ",
    "could not be found",
    "unable to launch the specified application",
    "was unable to find the specified executable",
)


class JobWatch:
    """What Open MPI's reports on stderr say about how the job ended."""

    def __init__(self):
        self.block: list[str] = []  #: lines of the report being read (Open MPI frames reports with dashes)
        self.aborted: tuple[int, int] | None = None  #: (rank, code) of the first MPI_Abort
        self.aborted_at: float | None = None
        self.killed: tuple[int, str, int] | None = None  #: (rank, host, signal) of a rank that died of a signal
        self.exited: tuple[int, int] | None = None  #: (rank, code) of the first rank that exited non-zero
        self.lost_host: str | None = None  #: the host whose daemon Open MPI lost
        self.launch_failed = False
        self.unanswered: str | None = None  #: a host whose daemon did not start
        self.started = False  #: the master said the cluster started (every rank ran)
        self.ranks_of: dict[str, str] = {}  #: host -> its ranks, as the master's start line says
        self.mid_line = False  #: the text passed on so far ends inside a line (a rank's line cut short)

    def feed(self, line: str, now: float) -> None:
        if line.startswith("started:"):  # "started: 1 master + 4 slaves on 3 hosts (h1: 0-1; h2: 2-3); ..."
            self.started = True
            hosts = line[line.find("(") + 1 : line.find(")")]
            self.ranks_of = dict(part.split(": ", 1) for part in hosts.split("; ") if ": " in part)
        if any(word in line.lower() for word in _LAUNCH) and not self.started:
            self.launch_failed = True
        if line.startswith("-" * 20):
            self._report(" ".join(self.block), now)
            self.block = []
        else:
            self.block.append(line.strip())

    def _report(self, text: str, now: float) -> None:
        if self.aborted is None and (m := _ABORT.search(text)):
            self.aborted, self.aborted_at = (int(m.group(1)), int(m.group(2))), now
        if self.killed is None and (m := _SIGNAL.search(text)):
            self.killed = (int(m.group(1)), m.group(2), int(m.group(3)))
        if self.lost_host is None and (m := _DAEMON.search(text)):
            self.lost_host = m.group(1)
        if self.unanswered is None and (m := _NO_DAEMON.search(text)):
            self.unanswered, self.launch_failed = m.group(1), True
        if self.exited is None and (m := _EXITED.search(text)):
            self.exited = (int(m.group(1)), int(m.group(2)))

    def outcome(self, returncode: int, signals: list[int]) -> tuple[int, str]:
        """The job's exit code and, where it is not mpirun's own, why (one line; "" when nothing to say);
        `signals`: the stop signals this launcher got, in order (a second one aborts: 128 + its number)."""
        self._report(" ".join(self.block), 0.0)
        if len(signals) >= 2:
            return 128 + signals[1], ""
        if self.aborted is not None:
            code = self.aborted[1]
            return (
                (code, "")
                if code in CODES or code > 128
                else (CRASH, f"rank {self.aborted[0]} aborted with code {code}: exit {CRASH} (a crash)")
            )
        if self.killed is not None:
            rank, host, sig = self.killed
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            return LOST, (
                f"rank {rank} on host {host} was killed by signal {sig} ({name}): exit {LOST} (a rank was lost)"
            )
        if self.lost_host is not None:
            ranks = self.ranks_of.get(self.lost_host, "?")
            return LOST, (
                f"Open MPI lost the daemon of host {self.lost_host} (ranks {ranks}): exit {LOST} (a rank was lost)"
            )
        code = exit_code(returncode)
        if code in CODES:
            return code, ""
        if self.launch_failed or not self.started:
            host = f" (host {self.unanswered} did not answer)" if self.unanswered else ""
            return START_FAILED, (
                f"Open MPI ended with its own code {code} before the ranks ran{host}: exit "
                f"{START_FAILED} (the job could not start)"
            )
        return LOST, f"Open MPI ended with its own code {code} (a connection to a rank or host was lost): exit {LOST}"


def run_job(cmd: list[str], env: dict[str, str]) -> int:
    """Run mpirun to its end (see the module's docstring); returns the job's exit code."""
    watch, signals = JobWatch(), []
    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
    )

    def on_signal(signum, frame):
        signals.append((signum, time.monotonic()))
        if len(signals) == 1:
            proc.send_signal(signal.SIGUSR1)
        else:
            say(watch, "second signal: aborting the job")
            proc.terminate()

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    reader = threading.Thread(target=_pass_on, args=(proc.stderr, watch), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            since = [t for t in (watch.aborted_at, signals[1][1] if len(signals) > 1 else None) if t is not None]
            if since and time.monotonic() - min(since) > ABORT_GRACE and proc.poll() is None:
                say(
                    watch,
                    f"mpirun did not end within {ABORT_GRACE:g}s of the "
                    f"{'abort' if watch.aborted_at else 'second signal'} (a host's daemon does not answer): "
                    "ending it and its local ranks",
                )
                end_tree(proc.pid)
        reader.join(timeout=0.5)  # an ssh client to a host cut off may hold the pipe open: not waited for
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    code, why = watch.outcome(proc.wait(), [signum for signum, _ in signals])
    if why:
        say(watch, why)
    return code


def end_tree(pid: int) -> None:
    """SIGKILL mpirun, everything it started here (the ranks on this host, its ssh clients) and its session."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _pass_on(stream, watch: JobWatch) -> None:
    """Copy mpirun's stderr to ours line by line, feeding the watch."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        watch.mid_line = not line.endswith("\n")
        watch.feed(line, time.monotonic())


def say(watch: JobWatch, text: str) -> None:
    """A line of the launcher's own, on a line of its own."""
    print("\n" * watch.mid_line + f"launcher: {text}", file=sys.stderr, flush=True)
    watch.mid_line = False
