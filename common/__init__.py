"""What the master and the control side (Spark, producers, the dashboard of a finished run) share, but the
slaves do not: the input readers and their checks, the generated workload, the dashboard's server and page,
CURVE for ZeroMQ.  Importable without numba or MPI, as Spark's Python workers import it."""
