"""Spark side of the engine (replay, aggregation, checkpoints); arrives with the control-plane issue."""
