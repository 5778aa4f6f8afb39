"""The run's plan: the validated configuration (TOML keys and/or the SQL query) compiled once into frozen, typed
settings per concern, durations on event time already in integer microseconds, the join's bounds with their open
or closed ends, the query's condition tree, filters and projection.

Rank 0 compiles it (`compile_plan`) and broadcasts it; every module reads its concern from here, so each key has
one reader (protocol.config and protocol.streams parse and check the dict; this module is the only one that reads
it after them) and a derived value ("checkpoints on", a duration in microseconds) is computed in one place.
`document` is the validated config as written to disk (summary.json, checkpoint manifests), never read for a
setting.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import eventtime
from protocol.aggregation import Aggregation, aggregation
from protocol.query import QueryPlan, config_plan, plan_of


@dataclass(frozen=True)
class Cluster:
    dispatchers: int  #: ranks 0..k-1 ingest and route (BiStream 3.2.3); the rest are slaves
    heartbeat_timeout: float  #: seconds a rank may stay silent; 0 resolved to the larger of 5 s and 20 epochs
    network: str
    ports: str


@dataclass(frozen=True)
class Source:
    kind: str  #: "generator", "file", "zmq" or "streams" (declared [streams.*])
    path: str
    rate: float
    speed: float
    batch: int
    endpoint: str
    producers: int
    idle_timeout: float
    max_message_tuples: int
    token: str
    token_file: str
    ack_endpoint: str
    ts_unit: str
    duplicate_window: int


@dataclass(frozen=True)
class Generator:
    """The paper's synthetic workload (common.workload); seconds as the paper gives them."""

    duration: float
    rate: float
    keys: int
    distribution: str
    skew: float
    zipf: float
    seed: int
    tuple_bytes: int
    disorder: float
    shift: float
    hot_share: float


@dataclass(frozen=True)
class Join:
    """r and s join iff their keys meet `predicate` and lower <= s.ts - r.ts <= upper (microseconds, open ends
    already moved one microsecond inside; `open` says which were open)."""

    type: str
    predicate: str  #: "equal", "band" or "less"
    band: int
    lower: int
    upper: int
    open: tuple[bool, bool]
    max_delay: int  #: microseconds of out-of-orderness allowed before a tuple is late

    @property
    def bounds(self) -> tuple[int, int]:
        return self.lower, self.upper

    @property
    def reach(self) -> int:
        """How far in event time a tuple finds partners either side of its own time."""
        return max(0, self.upper, -self.lower)


@dataclass(frozen=True)
class Kafka:
    """A stream's Kafka topic(s) (protocol.streams.KAFKA_KEYS); `config` holds librdkafka settings as written."""

    bootstrap: str
    topics: tuple[str, ...]  #: with a pattern: the topics it matched as the run started (`Plan.with_topics`)
    pattern: str
    group: str
    config: dict
    bounded: bool
    on_lost: str
    format: str
    avro_schema: str
    registry_header: bool
    select: dict  #: {column, value, values} when both streams read one topic, else {}


@dataclass(frozen=True)
class Stream:
    """One of the join's two streams (protocol.streams), R first; durations in microseconds."""

    name: str
    side: str  #: "R" or "S"
    path: str
    endpoint: str
    producers: int
    ack_endpoint: str
    kafka: Kafka | None
    schema: dict
    time_format: tuple[str, ...]
    key: tuple[str, ...]
    time: str
    time_unit: str
    id: str
    max_delay: int
    idle_timeout: float  #: wall-clock seconds
    payload: str | tuple[str, ...]  #: "*" or the column names
    prefix: str
    select: dict  #: the single file's: {column, value} its rows are taken by

    @property
    def live(self) -> bool:
        return bool(self.endpoint or self.kafka)


@dataclass(frozen=True)
class Epochs:
    distribution: float  #: seconds between two sends to a slave
    reorganization: float  #: seconds between two balancing decisions


@dataclass(frozen=True)
class Partitioning:
    partitions: int
    subgroups: int


@dataclass(frozen=True)
class Tuning:
    block_size: int
    theta_min: int
    theta_max: int
    max_depth: int


@dataclass(frozen=True)
class Master:
    buffer_capacity: int
    stall_timeout: float


@dataclass(frozen=True)
class Balance:
    enabled: bool
    supplier_threshold: float
    consumer_threshold: float
    buffer_capacity: int
    choice: str
    declustering: bool
    gamma: float
    initial_slaves: int
    seed: int


@dataclass(frozen=True)
class HotKeys:
    enabled: bool
    threshold: float
    grid: int
    max_keys: int
    sketch: int


@dataclass(frozen=True)
class Checkpoint:
    interval: int  #: distribution epochs between two checkpoints; 0 = none
    root: Path  #: checkpoint.path, or checkpoints/ in output.path
    keep: int
    archive: bool

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass(frozen=True)
class Sink:
    """The Kafka result sink (`[output.kafka]`); `run` and `complete` are set as the run starts (master.sink)."""

    topic: str
    bootstrap: str
    config: dict
    format: str
    marker_topic: str
    timeout: float
    run: str = ""
    complete: bool = False


@dataclass(frozen=True)
class Output:
    path: Path
    format: str
    flush_rows: int
    result_chunk_rows: int
    progress: float
    zmq_endpoint: str
    ordered: bool
    wait_subscribers: int
    subscriber_buffer_bytes: int
    subscriber_timeout: float
    kafka: Sink


@dataclass(frozen=True)
class Security:
    allow_remote: bool
    server_key: str
    client_keys: str


@dataclass(frozen=True)
class Metrics:
    endpoint: str
    log_interval: float


@dataclass(frozen=True)
class Aggregate:
    """Phase one of the two-phase aggregation (`enabled`: the slaves run it) and `view`, `[aggregate]` in result
    columns, which control.aggregate merges the partials into."""

    enabled: bool
    flush_interval: float
    view: Aggregation


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    source: Source
    generator: Generator
    join: Join
    streams: tuple[Stream, ...]  #: the declared [streams.*], R first; () without them
    query: QueryPlan | None  #: the SQL query's plan; None for the TOML form
    epochs: Epochs
    partitioning: Partitioning
    tuning: Tuning
    master: Master
    balance: Balance
    hotkeys: HotKeys
    checkpoint: Checkpoint
    output: Output
    security: Security
    metrics: Metrics
    aggregate: Aggregate
    #: the two streams the join reads (the declared ones, else the generator's, the single file's or the pushed
    #: one's as two streams)
    inputs: tuple[Stream, Stream]
    #: the plan as the query's words say it (the TOML form's too): what `streamjoin explain` prints
    shape: QueryPlan
    document: dict  #: the validated config as written to disk; never read for a setting

    @property
    def dtype(self):
        """The run's tuple records (protocol.tuples), with the words of its query's pair condition if any."""
        from protocol.tuples import tuple_dtype

        return tuple_dtype(self.generator.tuple_bytes, self.query.term_words if self.query is not None else 0)

    @property
    def live_endpoints(self) -> list[str]:
        """The config keys of the live inputs a run binds (producers push to them): `source.endpoint` of a ZeroMQ
        source, `streams.NAME.endpoint` of live declared streams."""
        return ["source.endpoint"] * (self.source.kind == "zmq") + [
            f"streams.{s.name}.endpoint" for s in self.streams if s.endpoint
        ]

    def explain(self) -> list[str]:
        """The plan as `streamjoin explain` prints it: the join in the query's words (its TOML form alike), each
        stream's input and lateness, then the concerns that shape the run."""
        seconds = lambda us: f"{us / eventtime.PER_SECOND:g} s"  # noqa: E731
        lines = self.shape.explain()
        for s in self.inputs:
            read = (
                f"files {s.path}"
                if s.path
                else f"producers at {s.endpoint}"
                if s.endpoint
                else f"Kafka {', '.join(s.kafka.topics) or s.kafka.pattern} at {s.kafka.bootstrap}"
                if s.kafka
                else f"the {self.source.kind}"
            )
            idle = f", idle after {s.idle_timeout:g} s" if s.idle_timeout else ""
            lines.append(f"stream {s.name} ({s.side}): {read}; late beyond max_delay {seconds(s.max_delay)}{idle}")
        c, hot, agg = self.checkpoint, self.hotkeys, self.aggregate.view
        lines += [
            f"cluster: {self.cluster.dispatchers} dispatcher(s), {self.partitioning.partitions} partitions, "
            f"heartbeat timeout {self.cluster.heartbeat_timeout:g} s",
            f"balance: {'on' if self.balance.enabled else 'off'}; hot keys: "
            + (f"grids of {hot.grid} above {hot.threshold:g} of the input" if hot.enabled else "off"),
            f"checkpoints: every {c.interval} epochs in {c.root}" if c.enabled else "checkpoints: off",
            "aggregation: "
            + (
                f"by {', '.join(agg.groups) or '(one group)'}"
                + (f", windows of {seconds(agg.window)} every {seconds(agg.slide)}" if agg.window else "")
                + f": {', '.join(m.name for m in agg.measures)}"
                if self.aggregate.enabled
                else "none"
            ),
            f"output: {self.output.path} ({self.output.format})"
            + (f", results published on {self.output.zmq_endpoint}" if self.output.zmq_endpoint else "")
            + (f", Kafka topic {self.output.kafka.topic}" if self.output.kafka.topic else ""),
        ]
        return lines

    def with_topics(self, topics: dict[str, list[str]]) -> Plan:
        """The plan with the topics Kafka streams' patterns matched as the run starts (rank 0, before the
        broadcast), in the document too (a recovery reads them from the checkpoint's)."""
        doc = copy.deepcopy(self.document)
        for name, found in topics.items():
            doc["streams"][name]["kafka"]["topics"] = list(found)
        streams = tuple(
            dataclasses.replace(s, kafka=dataclasses.replace(s.kafka, topics=tuple(topics[s.name])))
            if s.name in topics
            else s
            for s in self.streams
        )
        return dataclasses.replace(self, streams=streams, document=doc)

    def with_sink(self, run: str, complete: bool) -> Plan:
        """The plan with the Kafka sink's run id and whether its end is in Kafka already (master.sink)."""
        doc = copy.deepcopy(self.document)
        doc["output"]["kafka"] |= {"run": run, "complete": complete}
        sink = dataclasses.replace(self.output.kafka, run=run, complete=complete)
        return dataclasses.replace(self, output=dataclasses.replace(self.output, kafka=sink), document=doc)


def _section(cls, table: dict, **derived):
    """A concern's dataclass from its validated table: every field read once, derived ones given."""
    return cls(**{f.name: derived[f.name] if f.name in derived else table[f.name] for f in dataclasses.fields(cls)})


def _kafka(k: dict) -> Kafka | None:
    if not k:
        return None
    return _section(Kafka, k, topics=tuple(k["topics"]))


def _stream(name: str, s: dict) -> Stream:
    return _section(
        Stream,
        s,
        name=name,
        kafka=_kafka(s["kafka"]),
        time_format=tuple(s["time_format"]),
        key=tuple(s["key"]),
        max_delay=eventtime.duration(s["max_delay"]),
        payload=s["payload"] if s["payload"] == "*" else tuple(s["payload"]),
        select=s.get("select", {}),
    )


def compile_plan(cfg: dict[str, Any]) -> Plan:
    """The plan of a validated config (protocol.config.load_config, or a run's written config)."""
    from protocol.streams import single_streams

    join, out, ck = cfg["join"], cfg["output"], cfg["checkpoint"]
    shape = config_plan(cfg)
    streams = tuple(_stream(n, s) for n, s in (cfg.get("streams") or {}).items())
    cluster = cfg["cluster"]
    epoch = cfg["epochs"]["distribution"]
    return Plan(
        cluster=_section(Cluster, cluster, heartbeat_timeout=cluster["heartbeat_timeout"] or max(5.0, 20 * epoch)),
        source=_section(Source, cfg["source"]),
        generator=_section(Generator, cfg["generator"]),
        join=Join(
            type=join["type"],
            predicate=join["predicate"],
            band=join["band"],
            lower=shape.lower,
            upper=shape.upper,
            open=shape.open,
            max_delay=eventtime.duration(join["max_delay"]),
        ),
        streams=streams,
        query=plan_of(cfg),
        epochs=_section(Epochs, cfg["epochs"]),
        partitioning=_section(Partitioning, cfg["partitioning"]),
        tuning=_section(Tuning, cfg["tuning"]),
        master=_section(Master, cfg["master"]),
        balance=_section(Balance, cfg["balance"]),
        hotkeys=_section(HotKeys, cfg["hotkeys"]),
        checkpoint=_section(Checkpoint, ck, root=Path(ck["path"] or Path(out["path"]) / "checkpoints")),
        output=_section(Output, out, path=Path(out["path"]), kafka=_section(Sink, out["kafka"])),
        security=_section(Security, cfg["security"]),
        metrics=_section(Metrics, cfg["metrics"]),
        aggregate=_section(Aggregate, cfg["aggregate"], view=aggregation(cfg)),
        inputs=streams or tuple(_stream(n, s) for n, s in single_streams(cfg["source"], join).items()),
        shape=shape,
        document=cfg,
    )


def load_plan(path=None, overrides=(), sql=None, slaves: int | None = None) -> Plan:
    """The plan of a TOML file, `--set` overrides and a query file (protocol.config.load_config), checked for
    `slaves` slaves when given."""
    from protocol.config import load_config, validate

    cfg = load_config(path, overrides, sql)
    if slaves is not None:
        validate(cfg, slaves=slaves)
    return compile_plan(cfg)
