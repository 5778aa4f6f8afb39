"""Slave: stores the windows of its partition-groups and joins each epoch's tuples (paper 003, IV-D)."""
