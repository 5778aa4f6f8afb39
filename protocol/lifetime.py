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

PR_SET_PDEATHSIG = 1
#: exit codes of every command of the cluster (master, launcher, supervisor): 0 done or stopped cleanly
CRASH = 1  #: an exception on a rank (MPI_Abort): the supervisor restarts
USER_ERROR = 2  #: a mistake in arguments, configuration, input or output folder: restarting cannot help


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (also usable as a Popen `preexec_fn`)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def exit_code(returncode: int) -> int:
    """A child's Popen return code as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode
