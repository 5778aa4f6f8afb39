"""Thin MPI helpers shared by both roles: waiting without spinning, receiving byte buffers, failing fast.

With 17 ranks on 2 cores a rank that busy-waits in a blocking receive steals
the core the master needs.  Waiting is therefore `Iprobe` plus a sleep that
backs off from 0.1 ms to 5 ms (paper 003 assumes ranks that block, not spin).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

from mpi4py import MPI

from protocol import liveness
from protocol.waiting import sleep_for
from protocol.lifetime import CRASH, USER_ERROR, die_with_parent
from protocol.startup import PLACED_HOSTS, whole_lines, without_pandas

if TYPE_CHECKING:
    from protocol.plan import Plan


def _poll(ready, timeout: float | None, soon: float | None = None) -> bool:
    """Call `ready()` until it is true, sleeping 0.1 ms doubling to 5 ms in between; False on timeout.  `soon`
    (time.monotonic): when the awaited message should come -- a slave's next batch, one distribution epoch after
    the last (paper 003, V-B).  The sleep then ends near that moment and the poll runs every 0.25 ms until 10 ms
    after it (from 3 ms before), so the batch waits about 0.1 ms to be seen instead of 2.5 ms (half the longest
    sleep) on average, without spinning in between."""
    pause = 1e-4
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return False
        time.sleep(sleep_for(pause, now, soon))
        pause = min(pause * 2, 5e-3)
    return True


def wait_probe(comm: MPI.Comm, source: int, tag: int, timeout: float | None = None) -> MPI.Status | None:
    """Status of the next matching message, or None on timeout."""
    return wait_probe_any(comm, [(source, tag)], timeout)


def wait_probe_any(
    comm: MPI.Comm, channels: list[tuple[int, int]], timeout: float | None = None, soon: float | None = None
) -> MPI.Status | None:
    """Status of the next message matching one of the (source, tag) `channels`, or None on timeout; `soon`:
    when one is expected (`_poll`)."""
    status = MPI.Status()
    return (
        status
        if _poll(
            lambda: any(comm.Iprobe(source=source, tag=tag, status=status) for source, tag in channels), timeout, soon
        )
        else None
    )


def wait_all_started(comm: MPI.Comm, plan: Plan, about=lambda rank: "") -> list[str]:
    """Every rank of the job calls this once it is ready to work (the slaves after importing their join
    kernels, which take about 0.7 s of CPU per rank: seconds with 16 slaves on 2 cores), the dispatchers
    before they start the clock of the run, so paced input and delays count from when the cluster can join.
    Then the heartbeats start (protocol.liveness; `about`: rank 0's note on a lost peer).  Returns every
    rank's host name; rank 0 checks them against the launcher's placement.

    What is built by then (modules, numba's and pyarrow's objects: hundreds of thousands) is moved out of the
    cyclic garbage collector's reach: every full collection during the run scanned it all again, a few
    percent of the cluster's CPU in profiles.  No collection first: it took 30 ms of CPU per rank (0.25 s of
    a 17-rank start on 2 cores) to free a few hundred objects the imports left."""
    gc.freeze()
    wait_barrier(comm)
    hosts = comm.allgather(MPI.Get_processor_name())  # right after the barrier: nobody waits in it
    if comm.rank == 0:
        check_placement(comm, hosts)
    liveness.start(comm, hosts, plan, about)
    return hosts


def check_placement(comm: MPI.Comm, hosts: list[str]) -> None:
    """Rank 0: end the job if its ranks run on fewer hosts than the launcher placed them on (deploy.launch
    puts that count in PLACED_HOSTS): a hostfile that Open MPI did not follow is an error, not a silent
    success on one host."""
    expected = int(os.environ.get(PLACED_HOSTS) or 0)
    if len(set(hosts)) < expected:
        print(
            f"error: the launcher placed the {len(hosts)} ranks on {expected} hosts, but they run on "
            f"{len(set(hosts))}: {', '.join(sorted(set(hosts)))} (check the hostfile's names, and that each "
            "host has its own host name)",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(USER_ERROR)


def wait_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps while it waits (MPI's blocking collectives spin: ranks waiting in a bcast while
    rank 0 read its config and input took 2 s of CPU each at start, measured with py-spy)."""
    request = comm.Ibarrier()
    _poll(request.Test, None)


def receive_start(comm: MPI.Comm) -> tuple[Plan | None, dict | None]:
    """Every rank but 0: the plan rank 0 broadcasts (None: it refused the configuration and said why) and where a
    recovered run starts from (None: from the beginning)."""
    plan = comm.bcast(None, root=0)
    return (None, None) if plan is None else (plan, comm.bcast(None, root=0))


def recv_bytes(comm: MPI.Comm, status: MPI.Status, spare=None):
    """Receive the probed message into a uint8 buffer of its exact size: the front of `spare` (a buffer whose
    contents are no longer used) if it is large enough, else a fresh one."""
    from protocol.arrays import message_buffer  # here: the ranks' first import stays light (master.__main__)

    buf = message_buffer(spare, status.Get_count(MPI.BYTE))
    comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())
    return buf


PROJECT = Path(__file__).resolve().parent.parent


def where(error: BaseException) -> str:
    """`file:line in function` of the innermost frame of this project that `error` passed through (an injected
    fault's own frame aside: where it was injected is the place)."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).is_relative_to(PROJECT) and not f.filename.endswith("faults.py")
    ]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{Path(f.filename).relative_to(PROJECT)}:{f.lineno} in {f.name}"


def run_rank(main: Callable[[], int], role: str) -> int:
    """Run one rank's `main`; an exception on it ends the whole job, loudly and at once.

    Without this a rank that raised printed a traceback and waited in MPI_Finalize while the others waited for
    its messages: the job hung, so no supervisor ever restarted it.  Here the rank prints one line naming
    itself, the error (with the path an OSError names) and where it was raised, then MPI_Abort ends every
    rank with CRASH.  An error of the environment (OSError, MemoryError) is that line; anything else is a bug
    and its traceback follows the line.  A SystemExit passes: its code is a decision every rank makes alike.
    """
    die_with_parent()
    without_pandas()
    whole_lines()
    try:
        code = main()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # noqa: BLE001 (every exception ends the job: a library's panic too)
        comm = MPI.COMM_WORLD
        print(
            f"error: rank {comm.rank} ({role}) failed: {type(error).__name__}: {error} "
            f"[at {where(error)}]; aborting the job",
            file=sys.stderr,
            flush=True,
        )
        if not isinstance(error, (OSError, MemoryError)):
            traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
        comm.Abort(CRASH)
        return CRASH
    liveness.stop(grace=FINALIZE_GRACE)
    quick_exit(code)


def quick_exit(code: int) -> NoReturn:
    """End a rank that has done its part: its other threads joined, the exit handlers run, MPI finalized, the output
    flushed -- then the process ends without tearing its modules down one by one, which takes a quarter of a
    second of CPU per rank (numba's and LLVM's objects), and the job ends only when its last rank has."""
    import atexit
    import threading

    threading._shutdown()  # what the interpreter's exit does first: thread pools told to end, other threads joined
    atexit._run_exitfuncs()
    if not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: seconds a rank that has done its part may wait in MPI_Finalize for the others (rank 0 writes the summary)
FINALIZE_GRACE = 60.0
