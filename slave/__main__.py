"""`python -m slave`: run one slave rank (also reached from `python -m master` on ranks > 0)."""

import os
import sys

from protocol.startup import BTL

os.environ.setdefault("OMPI_MCA_btl", BTL)  # before MPI_Init reads it: under a bare mpirun too

from mpi4py import MPI

from protocol.mpi import run_rank
from slave.run import run

# `python -m master` hands its slave ranks over with the configuration it already received
sys.exit(run_rank(lambda: run(MPI.COMM_WORLD, globals().get("RECEIVED")), "slave"))
