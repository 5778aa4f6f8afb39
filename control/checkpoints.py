"""`python -m control.checkpoints list|verify|compact [--path DIR | --config run.toml]`: check and tidy checkpoints.

`verify` reads every part of every complete checkpoint with Spark (one task
per part, so it scales with the cluster that wrote them) and checks that it is
there, has the size the manifest gives, decodes, and holds the tuples the
manifest claims.  `compact` removes the checkpoints a newer complete one has
superseded (keeping `--keep`), and unfinished ones older than those.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from control.spark import session
from protocol import checkpoint
from protocol.config import ConfigError
from protocol.lifetime import invocation
from protocol.plan import compile_plan, load_plan


def scan(spark, directory: Path, manifest: dict) -> list[str]:
    """Problems found in one complete checkpoint (empty when it is sound)."""
    size = compile_plan(manifest["config"]).dtype.itemsize

    def inspect(item):
        path, data = item
        name = path.rsplit("/", 1)[-1]
        try:
            return name, len(data), checkpoint.part_tuples(name, data, size), None
        except checkpoint.CheckpointError as e:
            return name, len(data), None, str(e)

    found = {
        name: (size, tuples, err)
        for name, size, tuples, err in spark.sparkContext.binaryFiles(f"file://{directory.resolve()}/*.state")
        .map(inspect)
        .collect()
    }
    problems = []
    for name, claim in manifest["parts"].items():
        if name not in found:
            problems.append(f"{name}: missing")
            continue
        size, tuples, err = found[name]
        if err:
            problems.append(err)
        elif size != claim["bytes"]:
            problems.append(f"{name}: {size} bytes, the manifest says {claim['bytes']}")
        elif claim.get("tuples") is not None and tuples != claim["tuples"]:
            problems.append(f"{name}: holds {tuples} tuples, the manifest says {claim['tuples']}")
    return problems


def describe(directory: Path) -> dict:
    try:
        m = checkpoint.load_manifest(directory)
    except checkpoint.CheckpointError as e:
        return {"checkpoint": directory.name, "complete": False, "why": str(e)}
    return {
        "checkpoint": directory.name,
        "complete": True,
        "id": m["id"],
        "slaves": m["slaves"],
        "tuples": sum(p["tuples"] or 0 for p in m["parts"].values()),
        "bytes": sum(p["bytes"] for p in m["parts"].values()),
        "source_position": m["master"]["consumed"] + sum(d["consumed"] for d in m.get("dispatchers", {}).values()),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.checkpoints"), description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("list", "verify", "compact"))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--path", help="checkpoint folder (checkpoint.path)")
    where.add_argument("--config", help="the run's TOML config: its checkpoint folder")
    p.add_argument("--keep", type=int, default=1, help="compact: complete checkpoints to keep (default 1)")
    p.add_argument("--spark-master", help="Spark master URL (default local[*], or spark-submit's --master)")
    a = p.parse_args(argv)
    try:
        root = Path(a.path) if a.path else load_plan(a.config).checkpoint.root
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folders = checkpoint.checkpoints(root)
    if not folders:
        print(f"no checkpoints under {root}", file=sys.stderr)
        return 1 if a.action == "verify" else 0
    if a.action == "list":
        for d in folders:
            print(json.dumps(describe(d)))
        return 0
    if a.action == "compact":
        removed = checkpoint.prune(root, max(a.keep, 1))
        print(f"removed {len(removed)} superseded checkpoints: {', '.join(d.name for d in removed) or 'none'}")
        return 0
    spark = session(a.spark_master, app="streamjoin-checkpoints")
    bad = 0
    for d in folders:
        try:
            manifest = checkpoint.load_manifest(d)
        except checkpoint.CheckpointError as e:
            print(f"{d.name}: incomplete, recovery skips it ({e})")
            continue
        problems = scan(spark, d, manifest)
        bad += bool(problems)
        print(f"{d.name}: " + ("ok, " + f"{len(manifest['parts'])} parts" if not problems else "; ".join(problems)))
    spark.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
