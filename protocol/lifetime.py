"""Exit codes, and no orphans: a process of the cluster dies with the process that started it (Linux).

The supervisor starts the launcher, the launcher mpirun, mpirun the ranks; each child asks the kernel
(prctl PR_SET_PDEATHSIG) for SIGKILL when its parent dies.  Without it a SIGKILLed supervisor or launcher
left mpirun and every rank running, and a restart then ran a second cluster beside them on the same folder.
No MPI here: the supervisor and the launcher use it before any MPI exists.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
#: exit codes of every command of the cluster (master, launcher, supervisor): 0 done or stopped cleanly
CRASH = 1  #: an exception on a rank (MPI_Abort): the supervisor restarts
USER_ERROR = 2  #: a mistake in arguments, configuration, input or output folder: restarting cannot help
CHANNEL = 3  #: a slave saw a batch missing on its channel from a dispatcher
LOST = 4  #: a rank was lost: it died, froze or its host was cut off (protocol.liveness, deploy.launch)
START_FAILED = 5  #: the job could not start: a host did not answer, Open MPI failed before the ranks ran
TOO_FEW = 6  #: the supervisor: fewer slaves than --min-slaves remain on the hosts that answer
SINK = 7  #: the Kafka result sink could not deliver within output.kafka.timeout (master.sink): restarted
#: records of a Kafka stream were deleted at the broker before the stream read them (its `on_lost` is "stop"):
#: a restart would find the same hole, so the supervisor stops
INPUT_LOST = 8
#: control.audit's own code for "could not audit" (a crash, a file it cannot read, a run it does not audit yet):
#: never 1, which is its "the results differ", and none of the cluster's codes, so a script running both tells them
#: apart
NOT_AUDITED = 9
#: every code a command of the cluster ends with besides 128 + N (killed by signal N); deploy.launch maps
#: any other code of Open MPI's to one of these
CODES = (0, CRASH, USER_ERROR, CHANNEL, LOST, START_FAILED, TOO_FEW, SINK, INPUT_LOST)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (also usable as a Popen `preexec_fn`)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def ignore_stop_signals() -> None:
    """A slave: mpirun forwards stop signals to every rank, and the master alone decides when the job stops."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def exit_code(returncode: int) -> int:
    """A child's Popen return code as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def invocation(module: str) -> str:
    """How a user runs the tool `module` ("control.audit"): `streamjoin audit` where the engine is the installed
    tool (its packages under streamjoin/_engine: streamjoin/__init__.py), `python -m control.audit` in a
    checkout; the tools' usage lines and hints say it so."""
    if Path(__file__).resolve().parent.parent.name != "_engine":
        return f"python -m {module}"
    return "streamjoin " + ("run" if module == "deploy.launch" else module.rsplit(".", 1)[-1])
