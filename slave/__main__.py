"""`python -m slave`: run one slave rank (also reached from `python -m master` on ranks > 0)."""
import sys

from mpi4py import MPI

from slave.run import run

sys.exit(run(MPI.COMM_WORLD))
