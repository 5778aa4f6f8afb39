"""The run's configuration: TOML file, `--set section.key=value` overrides, validation.

Every key has a default and a one-line description: docs/configuration.md is
made from `DEFAULTS` by `python -m protocol.config --reference` (`make docs`).
Anything wrong stops the run before it starts with one `ConfigError` that names
the key.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from protocol import aggregation, eventtime, streams as streams_config
from protocol.access import check_endpoints, check_http_endpoint, check_producers
from protocol.durations import DURATION_KEYS, from_text
from protocol.errors import ConfigError
from protocol.predicates import JOIN_TYPES
from protocol.query import apply_query, plan_of
from protocol.tuples import BASE_TUPLE_BYTES


#: section -> key -> (default, description)
DEFAULTS: dict[str, dict[str, tuple[Any, str]]] = {
    "cluster": {
        "dispatchers": (
            1,
            "ranks 0..k-1 each ingest a 1/k share of the input and route it (BiStream 3.2.3); slaves are the rest",
        ),
        "heartbeat_timeout": (
            0.0,
            "a rank silent this long is lost and the job ends (a slave that no longer hears "
            "rank 0 exits); 0 = the larger of 5 s and 20 distribution epochs "
            "(docs/operating.md)",
        ),
        "network": (
            "",
            "the address range the ranks and Open MPI's daemons talk over between hosts, e.g. "
            '"10.0.0.0/24" ("" = Open MPI\'s choice); docs/operating.md lists the ports',
        ),
        "ports": (
            "",
            'TCP ports "A-B" Open MPI listens on between hosts, for a firewall: the ranks take the first '
            'half, the daemons the second ("" = any it picks)',
        ),
    },
    "source": {
        "kind": (
            "generator",
            '"generator" (built-in b-model workload), "file" (CSV/Parquet at `path`) or "zmq" (live, at `endpoint`)',
        ),
        "path": ("", 'input file for kind = "file": columns stream (R/S), id, ts, key, [value]'),
        "rate": (0.0, "arrival pacing in tuples/s (both streams together); 0 = as fast as the cluster accepts"),
        "speed": (
            0.0,
            "arrival pacing by the input's own event time, this many times faster than it says (1 = as the times "
            "say: bursts and gaps kept; a replay's --speed); 0 = off (source.rate paces)",
        ),
        "batch": (65536, "tuples the master ingests per step"),
        "endpoint": ("tcp://127.0.0.1:5555", 'kind = "zmq": where the master binds its PULL socket for producers'),
        "producers": (1, 'kind = "zmq": the input ends after this many producers sent their END message'),
        "idle_timeout": (
            0.0,
            'kind = "zmq": the input also ends after this many seconds without a message (0 = never)',
        ),
        "max_message_tuples": (65536, 'kind = "zmq": larger messages are rejected whole'),
        "token": (
            "",
            'kind = "zmq": only producers presenting this shared secret are let in ("" = any local process '
            "may feed and end the input); never logged",
        ),
        "token_file": (
            "",
            'kind = "zmq": a file holding the token (read at start; keeps it off command lines); not with `token`',
        ),
        "ack_endpoint": (
            "",
            'kind = "zmq", with checkpoints: where the master publishes what each checkpoint made '
            'durable per producer, so producers resend after a crash ("" = no acknowledgements)',
        ),
        "ts_unit": (
            "s",
            'kind = "file": the unit of numbers in the ts column, "s", "ms", "us" or "ns" (timestamp '
            "columns carry their own; docs/input.md)",
        ),
        "duplicate_window": (
            1000000,
            'files (kind = "file", and declared streams with an `id`): a repeated id is found when its first row '
            "is at most this many rows earlier (always when ids rise per stream)",
        ),
    },
    "generator": {
        "duration": (60.0, "seconds of event time to generate"),
        "rate": (50000.0, "mean tuples/s per stream in event time (Poisson arrivals)"),
        "keys": (1048576, "join-key domain size"),
        "distribution": (
            "bmodel",
            '"bmodel" (the paper), "uniform" (few `keys`: high key duplication) or "zipf" (heavy hitters)',
        ),
        "skew": (0.7, "b-model bias of the key distribution (0.5 = uniform; paper default 0.7)"),
        "zipf": (1.0, 'with distribution = "zipf": the exponent s, P(k-th most frequent key) ~ 1/k^s'),
        "seed": (1, "random seed; the same seed gives the same streams"),
        "tuple_bytes": (
            64,
            f"bytes per tuple on the wire and in the window (a multiple of 8, at least {BASE_TUPLE_BYTES}; paper 64)",
        ),
        "disorder": (0.0, "event times are shifted back by up to this many seconds (out-of-order input)"),
        "shift": (0.0, "every this many seconds the hot keys change (0 = never): skew that moves"),
        "hot_share": (0.0, "this share of both streams carries one single key (a heavy hitter), on top of the b-model"),
    },
    "join": {
        "window": (
            1.0,
            "join r and s iff r.key == s.key and |r.ts - s.ts| <= window (seconds): shorthand for "
            "lower = -window, upper = window",
        ),
        "lower": (
            None,
            "with `upper`, in place of `window`: join r and s iff lower <= s.ts - r.ts <= upper (seconds, "
            "either may be negative; unset: -window)",
        ),
        "upper": (None, "with `lower`: the largest s.ts - r.ts that joins (seconds; unset: window)"),
        "max_delay": (0.5, "allowed out-of-orderness in ts; later tuples go to the late output"),
        "predicate": ("equal", '"equal" (r.key == s.key), "band" (|r.key - s.key| <= band) or "less" (r.key < s.key)'),
        "band": (0, 'with predicate = "band": the largest key distance that joins'),
        "type": (
            "inner",
            '"inner" (pairs), "left" / "right" / "full" (also each R / S / both row without a partner, '
            'once, at expiry), "semi" (each R with a partner, once) or "anti" (each R without one, at '
            "expiry): docs/joins-and-hot-keys.md",
        ),
    },
    "query": {
        "sql": (
            "",
            "the join as a Spark SQL query over the [streams.NAME] tables (keys, time bounds, conditions on the "
            'pair, filters per stream, the result columns: docs/query.md); "" = the join.* keys say it',
        )
    },
    "epochs": {
        "distribution": (0.25, "seconds between two sends of buffered tuples to a slave"),
        "reorganization": (5.0, "seconds between two balancing decisions (load averaged over this epoch)"),
    },
    "partitioning": {
        "partitions": (60, "hash partitions (mini-buffers per stream at the master; paper 60); >= slaves"),
        "subgroups": (
            2,
            "slaves are served in this many slots per distribution epoch (paper V-B); capped at the slave count",
        ),
    },
    "tuning": {
        "block_size": (64, "tuples per window block (the unit of expiry)"),
        "theta_min": (4, "merge a mini-partition-group with its buddy below this many blocks"),
        "theta_max": (256, "split a mini-partition-group above this many blocks (extendible hashing)"),
        "max_depth": (
            12,
            "largest global depth of a partition-group's extendible-hash directory (0 = no tuning: one "
            "bucket per group)",
        ),
    },
    "master": {
        "buffer_capacity": (
            4000000,
            "tuples the master's mini-buffers may hold before ingest pauses (256 MB of 64-byte tuples)",
        ),
        "stall_timeout": (
            0.0,
            "seconds pending work may stand still before the job ends naming what it waits for "
            "(0 = 8 distribution epochs, at least 10 s, plus twice the slowest batch)",
        ),
    },
    "balance": {
        "enabled": (
            True,
            "move partition-groups between slaves by their load (paper IV-C); balance.declustering also "
            "adapts the active slave count",
        ),
        "supplier_threshold": (0.5, "average buffer occupancy above which a slave is a supplier (paper 0.5)"),
        "consumer_threshold": (0.01, "average buffer occupancy below which a slave is a consumer (paper 0.01)"),
        "buffer_capacity": (
            20000,
            "tuples a slave's buffer holds; occupancy = mean tuples not yet joined at its slots / this",
        ),
        "choice": ("largest_fit", '"random" (the paper) or "largest_fit": which partition-group a supplier yields'),
        "declustering": (
            False,
            "also adapt the number of active slaves (paper V-A): shrinks a cluster that keeps up easily",
        ),
        "gamma": (2.0, "one more active slave when suppliers > gamma x consumers (paper V-A)"),
        "initial_slaves": (0, "slaves active at start (0 = all)"),
        "seed": (1, "seed of the random group choice"),
    },
    "hotkeys": {
        "enabled": (
            False,
            "give keys above `threshold` of the input a grid of sub-groups on several slaves (equi-join)",
        ),
        "threshold": (0.1, "share of the input over a reorganization epoch that makes a key hot"),
        "grid": (
            4,
            "most sub-groups per hot key (its S tuples are spread over them, its R tuples copied to all; a "
            "full join: two such grids, the second with R spread and S copied)",
        ),
        "max_keys": (4, "most hot keys at once"),
        "sketch": (
            64,
            "counters of the frequent-items summary at the master (keys above 1/sketch of the input are seen)",
        ),
    },
    "checkpoint": {
        "interval": (0, "distribution epochs between two checkpoints of the whole cluster (0 = none)"),
        "path": ("", "checkpoint folder (default: `checkpoints/` in output.path)"),
        "keep": (2, "complete checkpoints kept; older ones are removed once a newer one is complete"),
        "archive": (True, "with checkpoints: log the accepted input as Parquet in `archive/` (the upstream backup)"),
    },
    "output": {
        "path": ("out", "output directory (results/, late/, rejected/, summary.json)"),
        "format": ("parquet", '"parquet" or "csv"'),
        "flush_rows": (500000, "a slave writes a results file once it holds this many rows"),
        "result_chunk_rows": (
            1 << 19,
            "a slave builds a batch's results in chunks of at most this many rows, each "
            "written and sent before the next (bounds a slave's memory under a hot key)",
        ),
        "progress": (1.0, "seconds between progress lines (0 = none)"),
        "zmq_endpoint": (
            "",
            'publish results with punctuations on this ZeroMQ endpoint (e.g. "tcp://127.0.0.1:5556"); "" = off',
        ),
        "ordered": (
            False,
            "with zmq_endpoint: publish results in order of the later tuple's ts (held until punctuated)",
        ),
        "wait_subscribers": (
            0,
            "with zmq_endpoint: wait for this many subscribers before ingesting (PUB drops what comes before)",
        ),
        "subscriber_buffer_bytes": (
            64 << 20,
            "with zmq_endpoint: bytes of results the master queues per subscriber "
            "(at least 65536); a subscriber further behind misses messages (its gaps "
            "counted); with ordered, results held beyond it pause ingest",
        ),
        "subscriber_timeout": (
            10.0,
            "with ordered: seconds a full subscriber may hold the stream (and the cluster) "
            "back before it misses messages as unordered",
        ),
    },
    "security": {
        "allow_remote": (False, "allow ZeroMQ endpoints on non-loopback addresses (then CURVE keys are required)"),
        "server_key": (
            "",
            "secret certificate of the cluster's ZeroMQ sockets (zmq.auth .key_secret file); enables CURVE",
        ),
        "client_keys": ("", "directory of the public certificates (.key) of producers and subscribers let in"),
    },
    "metrics": {
        "endpoint": (
            "127.0.0.1:9464",
            'HOST:PORT of the Prometheus /metrics and the live dashboard (rank 0); "" = off',
        ),
        "log_interval": (5.0, "seconds between two Parquet files of the metrics log in `metrics/` (0 = no log)"),
    },
    "aggregate": {
        "enabled": (
            False,
            "slaves pre-aggregate their results into aggregates/ (phase one; merged by control.aggregate)",
        ),
        "group_by": (
            "key",
            '"key" (R\'s key column(s)), "r_key", "s_key", or a result column or a list of them '
            '(`["impressions_ad_id"]`, `["r_key", "s_key"]`, [] = one group)',
        ),
        "value": (
            "r_value",
            '"r_value" or "s_value": without [streams.*], `measures` = ["count"] means count and the sum, '
            "min, max and avg of this column (refused with [streams.*]: use `measures`)",
        ),
        "window": (0.0, "tumbling window in seconds on a row's time (a pair: its later tuple's); 0 = no window"),
        "slide": (
            0.0,
            "seconds between two windows' starts, below `window` for hopping windows (0 = `window`: tumbling)",
        ),
        "time": (
            "",
            'the timestamp result column windows are cut on (the single file: "r_ts" or "s_ts"); "" = the '
            "pair's time, the later of the two streams' time columns (a row alone: its own)",
        ),
        "measures": (
            ["count"],
            "the view's measures: count, sum(COL), min(COL), max(COL), avg(COL) over numeric "
            "or decimal result columns, count_distinct(COL) (exact)",
        ),
        "flush_interval": (5.0, "seconds between two partial-aggregate files of a slave"),
    },
}

_CHOICES = {
    ("source", "kind"): ("generator", "file", "zmq", "streams"),
    ("source", "ts_unit"): tuple(eventtime.UNITS),
    ("generator", "distribution"): ("bmodel", "uniform", "zipf"),
    ("output", "format"): ("parquet", "csv"),
    ("balance", "choice"): ("random", "largest_fit"),
    ("join", "predicate"): ("equal", "band", "less"),
    ("join", "type"): JOIN_TYPES,
    ("aggregate", "value"): ("r_value", "s_value"),
}
_POSITIVE = {
    ("generator", "rate"),
    ("generator", "keys"),
    ("generator", "duration"),
    ("generator", "zipf"),
    ("epochs", "distribution"),
    ("epochs", "reorganization"),
    ("partitioning", "partitions"),
    ("partitioning", "subgroups"),
    ("tuning", "block_size"),
    ("tuning", "theta_max"),
    ("master", "buffer_capacity"),
    ("output", "flush_rows"),
    ("output", "result_chunk_rows"),
    ("source", "batch"),
    ("balance", "buffer_capacity"),
    ("balance", "gamma"),
    ("checkpoint", "keep"),
    ("cluster", "dispatchers"),
    ("hotkeys", "grid"),
    ("hotkeys", "max_keys"),
    ("hotkeys", "sketch"),
    ("aggregate", "flush_interval"),
    ("source", "producers"),
    ("source", "max_message_tuples"),
    ("source", "duplicate_window"),
    ("output", "subscriber_buffer_bytes"),
}
_NON_NEGATIVE = {
    ("source", "rate"),
    ("join", "window"),
    ("join", "max_delay"),
    ("tuning", "theta_min"),
    ("tuning", "max_depth"),
    ("generator", "disorder"),
    ("generator", "shift"),
    ("output", "progress"),
    ("balance", "supplier_threshold"),
    ("balance", "consumer_threshold"),
    ("balance", "initial_slaves"),
    ("checkpoint", "interval"),
    ("join", "band"),
    ("aggregate", "window"),
    ("aggregate", "slide"),
    ("source", "idle_timeout"),
    ("output", "wait_subscribers"),
    ("master", "stall_timeout"),
    ("metrics", "log_interval"),
    ("output", "subscriber_timeout"),
    ("cluster", "heartbeat_timeout"),
}


def _typename(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[type(v)]


def _check_type(name: str, default: Any, value: Any) -> Any:
    if default is None:  # join.lower / join.upper: unset by default, a number of seconds when set
        default = 0.0
    if isinstance(default, bool) or isinstance(value, bool):
        if type(value) is not type(default):
            raise ConfigError(f"{name}: expected {_typename(default)}, got {value!r}")
        return value
    if isinstance(default, float) and isinstance(value, int):
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"{name}: expected {_typename(default)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: must be a finite number, got {value!r}")
    return value


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    name, raw = item.split("=", 1)
    section, key = name.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set output.format=csv
    return section, key, value


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), sql: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """Defaults, then the TOML file, then the overrides, then the query in the file `sql` (query.sql); validated."""
    cfg = {s: {k: d for k, (d, _) in keys.items()} for s, keys in DEFAULTS.items()}
    user: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            user = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    streams = user.pop("streams", {})  # [streams.NAME] tables: protocol.streams
    # [output.kafka], the result sink: protocol.streams as well (the Kafka settings' rules are shared)
    sink = user["output"].pop("kafka", {}) if isinstance(user.get("output"), dict) else {}
    items = [(s, k, v) for s, sec in user.items() for k, v in (sec.items() if isinstance(sec, dict) else [(None, sec)])]
    items += [_parse_override(o) for o in overrides]
    for section, key, value in items:
        if section == "streams":
            streams_config.set_key(streams, key, value, ConfigError)
            continue
        if section == "output" and key is not None and key.startswith("kafka."):
            streams_config.set_sink_key(sink, key.removeprefix("kafka."), value)
            continue
        if section not in DEFAULTS:
            raise ConfigError(f"unknown section [{section}] (known: {', '.join(DEFAULTS)})")
        if key is None:
            raise ConfigError(f"[{section}] must be a table of keys")
        if key not in DEFAULTS[section]:
            raise ConfigError(f"unknown key {section}.{key} (known in [{section}]: {', '.join(DEFAULTS[section])})")
        value = from_text(section, key, value, ConfigError)  # a duration as text: "30s", "250ms"
        if (section, key) == ("aggregate", "group_by") and isinstance(value, list):
            cfg[section][key] = value  # a list of result columns (declared streams): protocol.aggregation
            continue
        cfg[section][key] = _check_type(f"{section}.{key}", DEFAULTS[section][key][0], value)
    named = {(s, k) for s, k, _ in items}
    if sql is not None:
        if cfg["query"]["sql"]:
            raise ConfigError(f"--sql {sql}: the config has a query already (query.sql): give one")
        try:
            cfg["query"]["sql"] = Path(sql).read_text()
        except OSError as e:
            raise ConfigError(f"--sql {sql}: cannot be read: {e.strerror}") from None
    if cfg["query"]["sql"]:
        apply_query(cfg["query"]["sql"], streams, cfg, named)
    if ("join", "window") in named and named & {("join", "lower"), ("join", "upper")}:
        raise ConfigError(
            "join.window: not together with join.lower / join.upper (window w is the shorthand for "
            "lower = -w, upper = w): set either window or lower and upper"
        )
    cfg["streams"] = streams_config.declared(streams, cfg["source"], cfg["join"], ConfigError)
    if ("aggregate", "value") in named and cfg["streams"]:
        raise ConfigError(
            "aggregate.value: not with [streams.*] (it names the single file's measured column, r_value or "
            "s_value, and declared streams' results have their own columns): use aggregate.measures, e.g. "
            '["count", "sum(clicks_cost)"]'
        )
    cfg["output"]["kafka"] = streams_config.kafka_sink(sink, ConfigError)
    if cfg["query"]["sql"] and cfg["aggregate"]["enabled"] and plan_of(cfg).projection is not None:
        raise ConfigError(
            "aggregate.enabled: with a query, it aggregates SELECT *'s columns (<stream>_<column>): "
            "select * in the query, or aggregate its results where they are read"
        )
    validate(cfg)
    return cfg


def _check_speed(cfg: dict) -> None:
    """Pacing by event time (master.sources.paced) paces stored input, alone."""
    src = cfg["source"]
    if src["speed"] <= 0:
        return
    live = src["kind"] == "zmq" or any(s["endpoint"] or s["kafka"] for s in cfg.get("streams", {}).values())
    why = (
        "source.rate: not with source.speed (one pacing at a time)"
        if src["rate"]
        else "checkpoint.interval: not with source.speed yet (the tuples it holds back would need a place in "
        "the checkpoint)"
        if cfg["checkpoint"]["interval"]
        else "source.speed: not for live input (it comes at its own pace)"
        if live
        else None
    )
    if why:
        raise ConfigError(why)


def validate(cfg: dict[str, dict[str, Any]], slaves: int | None = None) -> None:
    """Value checks that do not depend on types; `slaves` adds the checks that need the cluster size."""
    for (s, k), choices in _CHOICES.items():
        if cfg[s][k] not in choices:
            raise ConfigError(f"{s}.{k}: must be one of {', '.join(map(repr, choices))}, got {cfg[s][k]!r}")
    for s, k in _POSITIVE:
        if not cfg[s][k] > 0:
            raise ConfigError(f"{s}.{k}: must be > 0, got {cfg[s][k]!r}")
    for s, k in _NON_NEGATIVE:
        if cfg[s][k] < 0:
            raise ConfigError(f"{s}.{k}: must be >= 0, got {cfg[s][k]!r}")
    if not 0.0 <= cfg["generator"]["hot_share"] < 1.0:
        raise ConfigError(f"generator.hot_share: must be in [0, 1), got {cfg['generator']['hot_share']!r}")
    if not 0.0 < cfg["generator"]["skew"] < 1.0:
        raise ConfigError(f"generator.skew: must be strictly between 0 and 1, got {cfg['generator']['skew']!r}")
    if cfg["generator"]["tuple_bytes"] < BASE_TUPLE_BYTES or cfg["generator"]["tuple_bytes"] % 8:
        # whole 8-byte words: every field stays aligned, which the compiled result gather reads them as
        raise ConfigError(
            f"generator.tuple_bytes: must be a multiple of 8 and at least {BASE_TUPLE_BYTES}, "
            f"got {cfg['generator']['tuple_bytes']!r}"
        )
    if cfg["tuning"]["theta_min"] * 2 > cfg["tuning"]["theta_max"]:
        raise ConfigError(
            "tuning.theta_min: must be at most half of tuning.theta_max "
            f"(got {cfg['tuning']['theta_min']} and {cfg['tuning']['theta_max']})"
        )
    if cfg["tuning"]["max_depth"] > 24:
        raise ConfigError(f"tuning.max_depth: must be at most 24, got {cfg['tuning']['max_depth']}")
    if cfg["balance"]["consumer_threshold"] > cfg["balance"]["supplier_threshold"]:
        raise ConfigError(
            "balance.consumer_threshold: must be at most balance.supplier_threshold "
            f"(got {cfg['balance']['consumer_threshold']} and {cfg['balance']['supplier_threshold']})"
        )
    _check_event_time(cfg)
    _check_bounds(cfg["join"])
    _check_cluster(cfg)
    _check_speed(cfg)
    if cfg["source"]["kind"] == "file" and not cfg["source"]["path"]:
        raise ConfigError('source.path: required when source.kind = "file"')
    if cfg["hotkeys"]["enabled"] and cfg["join"]["predicate"] != "equal":
        raise ConfigError('hotkeys.enabled: only for join.predicate = "equal" (key ranges keep a hot key whole)')
    if not 0.0 < cfg["hotkeys"]["threshold"] <= 1.0:
        raise ConfigError(f"hotkeys.threshold: must be in (0, 1], got {cfg['hotkeys']['threshold']!r}")
    if cfg["hotkeys"]["grid"] < 2:
        raise ConfigError(f"hotkeys.grid: must be at least 2, got {cfg['hotkeys']['grid']!r}")
    if cfg["output"]["subscriber_buffer_bytes"] < 65536:
        raise ConfigError(
            "output.subscriber_buffer_bytes: must be at least 65536 (one result message), got "
            f"{cfg['output']['subscriber_buffer_bytes']!r}"
        )
    placed = [
        f"streams.{n}.{'kafka' if spec['kafka'] else 'endpoint'}"
        for n, spec in cfg.get("streams", {}).items()
        if spec["kafka"] or spec["endpoint"]
    ]
    if placed and cfg["checkpoint"]["interval"] and len(placed) < len(cfg["streams"]):
        raise ConfigError(
            f"{placed[0]}: with checkpoint.interval, not beside a stream of files yet: a recovery goes on from "
            "each live stream's checkpointed place (a topic's offsets, producers' positions), and the files "
            "would have to go on from their checkpointed rows (make both streams live, or leave checkpoints off)"
        )
    if placed and cfg["cluster"]["dispatchers"] > 1 and len(placed) < len(cfg["streams"]):
        raise ConfigError(
            f"{placed[0]}: with cluster.dispatchers > 1, not beside a stream of files yet: each dispatcher takes "
            "its own share of a live stream (its topic partitions, its own producers), and would have to read the "
            "files whole and keep their share (make both streams live, or run one dispatcher)"
        )
    aggregation.check(cfg, ConfigError)
    check_endpoints(cfg)
    check_http_endpoint("metrics.endpoint", cfg["metrics"]["endpoint"], cfg["security"]["allow_remote"])
    check_producers(cfg)
    if slaves is not None:
        slaves -= cfg["cluster"]["dispatchers"] - 1  # the ranks after the dispatchers
        if slaves < 1:
            raise ConfigError(
                f"the cluster needs at least one slave besides its {cfg['cluster']['dispatchers']} "
                f"dispatcher(s): run with mpirun -n {cfg['cluster']['dispatchers'] + 1} or more"
            )
        if cfg["balance"]["initial_slaves"] > slaves:
            raise ConfigError(
                f"balance.initial_slaves: must be <= the number of slaves ({slaves}), "
                f"got {cfg['balance']['initial_slaves']}"
            )
        if cfg["partitioning"]["partitions"] < slaves:
            raise ConfigError(
                f"partitioning.partitions: must be >= the number of slaves ({slaves}), "
                f"got {cfg['partitioning']['partitions']}"
            )


def _check_event_time(cfg: dict[str, dict[str, Any]]) -> None:
    """Event-time durations become integer microseconds (protocol.eventtime): they must fit, and a tumbling
    aggregation window must not round to nothing."""
    limit = eventtime.DURATION_LIMIT // eventtime.PER_SECOND
    for s, k in (
        ("join", "window"),
        ("join", "max_delay"),
        ("aggregate", "window"),
        ("aggregate", "slide"),
        ("generator", "duration"),
        ("generator", "disorder"),
    ):
        if cfg[s][k] >= limit:
            raise ConfigError(f"{s}.{k}: must be below {limit} seconds, got {cfg[s][k]!r}")
    if cfg["aggregate"]["window"] > 0 and eventtime.duration(cfg["aggregate"]["window"]) == 0:
        raise ConfigError(
            f"aggregate.window: must be 0 or at least one microsecond (event time is counted in "
            f"microseconds), got {cfg['aggregate']['window']!r}"
        )


def _check_cluster(cfg: dict[str, dict[str, Any]]) -> None:
    """The heartbeat timeout must leave room for a few heartbeats (one per distribution epoch at least); the
    network is an address range."""
    timeout, epoch = cfg["cluster"]["heartbeat_timeout"], cfg["epochs"]["distribution"]
    if timeout and timeout < min(1.0, 4 * epoch):
        raise ConfigError(
            f"cluster.heartbeat_timeout: must be 0 (automatic) or at least {min(1.0, 4 * epoch):g}s "
            f"(four distribution epochs, at most 1 s), got {timeout!r}"
        )
    ports = cfg["cluster"]["ports"]
    if ports and (
        not re.fullmatch(r"\d+-\d+", ports)
        or not 1024 <= int(ports.split("-")[0])
        or int(ports.split("-")[1]) - int(ports.split("-")[0]) < 3
        or int(ports.split("-")[1]) > 65535
    ):
        raise ConfigError(f'cluster.ports: expected a range "A-B" of at least 4 ports within 1024-65535, got {ports!r}')
    if cfg["cluster"]["network"]:
        try:
            ipaddress.ip_network(cfg["cluster"]["network"], strict=False)
        except ValueError as e:
            raise ConfigError(
                f'cluster.network: expected an address range such as "10.0.0.0/24", got '
                f"{cfg['cluster']['network']!r} ({e})"
            ) from None


def _check_bounds(join: dict[str, Any]) -> None:
    """join.lower and join.upper come together (one alone would silently take the other from window), below
    the duration limit either way, and lower <= upper (else nothing joins)."""
    lower, upper = join.get("lower"), join.get("upper")
    if (lower is None) != (upper is None):
        given, missing = ("lower", "upper") if upper is None else ("upper", "lower")
        raise ConfigError(f"join.{missing}: required with join.{given} (they replace join.window together)")
    if lower is None:
        return
    limit = eventtime.DURATION_LIMIT // eventtime.PER_SECOND
    for k in ("lower", "upper"):
        if not abs(join[k]) < limit:
            raise ConfigError(f"join.{k}: must be between -{limit} and {limit} seconds, got {join[k]!r}")
    if lower > upper:
        raise ConfigError(f"join.lower: must be at most join.upper (got {lower!r} and {upper!r}): no pair would join")


def reference() -> str:
    """docs/configuration.md: every key with its default, the values it takes and its meaning, from DEFAULTS
    (tests/unit/test_config.py fails when the committed page differs)."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list of strings"}
    toml = lambda v: (
        json.dumps(v)
        if isinstance(v, (str, list))
        else str(v).lower()
        if isinstance(v, bool)
        else "unset"
        if v is None
        else repr(v)
    )

    def values(s: str, k: str, default: Any) -> str:
        if (s, k) in _CHOICES:
            return ", ".join(map(toml, _CHOICES[s, k]))
        return ("duration" if (s, k) in DURATION_KEYS else kinds[type(default)]) + (
            " > 0" if (s, k) in _POSITIVE else " >= 0" if (s, k) in _NON_NEGATIVE else ""
        )

    lines = [
        "# Configuration reference",
        "",
        "<!-- made by `python -m protocol.config --reference > docs/configuration.md` (make docs) from "
        "protocol/config.py; do not edit by hand -->",
        "",
        "A TOML file (`--config my.toml`), one table per section; every key can be overridden with "
        "`--set section.key=value` (the value in TOML syntax; a bare word is a string). An unknown section or "
        "key, a wrong type or an impossible value stops the run before it starts with one message that names "
        "the key; docs/refusals.md lists the combinations refused. A duration is a number of seconds or text "
        "with a unit: "
        '`"30s"`, `"250ms"`, `"2m"`, `"1h"` (ns, us, ms, s, m, h, d).',
    ]
    for section, keys in DEFAULTS.items():
        lines += ["", f"## [{section}]", "", "| key | default | values | meaning |", "|---|---|---|---|"]
        for key, (default, meaning) in keys.items():
            meaning = meaning.replace("|", "\\|")  # |r.ts - s.ts| inside a table cell
            lines.append(f"| `{section}.{key}` | `{toml(default)}` | {values(section, key, default)} | {meaning} |")
    return "\n".join(lines + streams_config.reference()) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--reference"]:
        sys.exit("usage: python -m protocol.config --reference > docs/configuration.md")
    sys.stdout.write(reference())
