"""`python -m slave`: run one slave rank (also reached from `python -m master` on ranks > 0)."""

import sys

from mpi4py import MPI

from protocol.mpi import run_rank
from slave.run import run

# `python -m master` hands its slave ranks over with the configuration it already received
sys.exit(run_rank(lambda: run(MPI.COMM_WORLD, globals().get("RECEIVED")), "slave"))
