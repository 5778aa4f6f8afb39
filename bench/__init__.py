"""The benchmarks (never imported by the engine), one module per concern; each imports only those above it:

* `search`: the sustained-rate search rule and the keep-up test (pure);
* `tables`: markdown tables and number formats (pure);
* `machine`: what the numbers depend on (CPU, cores, versions);
* `inputs`: the generated input files, long enough for the rates run, kept in a cache folder;
* `cluster`: one mpirun of the engine per run, and `Bench`, the search over slave counts;
* `big`: one file of hundreds of millions of rows end to end (`python -m bench.big`);
* `kernel`: the single-core limit (`python -m bench.kernel`);
* `spark`: the peer, Spark Structured Streaming's join on the same data (`python -m bench.spark`);
* `paper`: the paper's figures beyond capacity (workloads, tuning off, epoch sweep) and the targets;
* `report`: report.md and the capacity and delay plots;
* `busy`, `balance`: a busy host and load balancing off and on (`python -m bench.balance`);
* `hotkeys`: a heavy hitter with the hot-key grid off and on (`python -m bench.hotkeys`);
* `__main__`: `python -m bench`, the whole capacity bench.

How to run them and the latest numbers: docs/benchmarks.md.
"""
