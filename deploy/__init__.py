"""Launching the cluster: the mpirun command line for one host or many (hostfile)."""
