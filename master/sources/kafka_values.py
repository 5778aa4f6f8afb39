"""Kafka record values into Arrow tables, a batch at a time (`streams.NAME.kafka.format`, docs/input.md#kafka-topics).

Each format reads a batch's values in one call of a library's batch reader, never one record at a time: `read`
gives the table of all of them, or None when one of them cannot be read (master.sources.kafka_input then finds
it by halving the batch, an error path), and `why` tells for one value what is wrong with it.

- json: one JSON object per value, joined by newlines and read by pyarrow's JSON reader under the declared
  fields (fields not declared ignored).
- csv: one CSV line per value, its cells in the order of the stream's `schema`, no header; pyarrow's CSV reader.
- avro: one Avro datum per value under the writer's schema (`kafka.avro_schema`, an .avsc file), optionally after
  the Confluent Schema Registry's 5-byte header (`kafka.registry_header`); the datums of a batch are framed as
  one block of an Avro object container in memory and read by polars' Avro reader (Rust, straight into Arrow
  columns), then the declared fields are taken and cast to their declared types.

The key, time and id fields are required: a value without them (or with them null) cannot be read.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson

from protocol.errors import ConfigError

#: pyarrow's JSON block, at least (a block must hold a whole record)
JSON_BLOCK = 1 << 20
REGISTRY_HEADER = 5  #: bytes before a Schema Registry-framed Avro datum: magic byte 0, the schema id (4 bytes)


def halved(read, values: list[bytes], lo: int, hi: int, good: list, bad: list) -> None:
    """Values lo..hi as tables into `good` ((first value, table)); those no table can hold into `bad`, found by
    halving the batch (an error path: a bad value costs about log2(batch) reads)."""
    table = read(values[lo:hi])
    if table is not None:
        good.append((lo, table))
    elif hi - lo == 1:
        bad.append(lo)
    else:
        mid = (lo + hi) // 2
        halved(read, values, lo, mid, good, bad)
        halved(read, values, mid, hi, good, bad)


class Values:
    """A format's reader: `read` a batch at once or None, `why` one value cannot be read."""

    def read(self, values: list[bytes]) -> pa.Table | None:
        raise NotImplementedError

    def why(self, value: bytes) -> tuple[str, str, str]:
        raise NotImplementedError

    def read_all(self, values: list[bytes]) -> tuple[list[tuple[int, pa.Table]], list[int]]:
        """The batch as tables ((first value, table)) and the indexes of the values none can hold."""
        good: list[tuple[int, pa.Table]] = []
        bad: list[int] = []
        halved(self.read, values, 0, len(values), good, bad)
        return good, bad


class JsonValues(Values):
    def __init__(self, fields: pa.Schema):
        self.fields = fields
        #: how a batch's values are parsed: one line each (False), or objects over several lines (pretty-printed)
        self._parse = {
            multiline: pajson.ParseOptions(
                explicit_schema=fields, newlines_in_values=multiline, unexpected_field_behavior="ignore"
            )
            for multiline in (False, True)
        }

    def read(self, values: list[bytes]) -> pa.Table | None:
        """The values, one JSON object each, read at once; None if one is not (a blank value would shift every
        row after it, so it fails the batch too)."""
        lengths = list(map(len, map(bytes.strip, values)))
        if min(lengths) == 0:
            return None
        text = b"\n".join(values)
        try:
            table = pajson.read_json(
                pa.BufferReader(text),
                read_options=pajson.ReadOptions(block_size=max(JSON_BLOCK, max(lengths) + 2)),
                parse_options=self._parse[text.count(b"\n") >= len(values)],
            )
        except pa.ArrowInvalid:
            return None
        return table if table.num_rows == len(values) else None

    def why(self, value: bytes) -> tuple[str, str, str]:
        """(column, reason, detail) of a value that cannot be read."""
        try:
            obj = json.loads(value)
        except ValueError as e:
            return "", "not JSON", str(e)
        if not isinstance(obj, dict):
            return "", "not JSON", f"a JSON {type(obj).__name__}, not an object"
        missing = [f.name for f in self.fields if not f.nullable and obj.get(f.name) is None]
        if missing:
            return missing[0], "missing column", f"{missing[0]} is {'null' if missing[0] in obj else 'missing'}"
        for f in self.fields:  # the first field that does not read as its declared type
            if f.name in obj:
                try:
                    pajson.read_json(
                        pa.BufferReader(json.dumps({f.name: obj[f.name]}).encode()),
                        parse_options=pajson.ParseOptions(explicit_schema=pa.schema([f])),
                    )
                except pa.ArrowInvalid as e:
                    return f.name, "wrong type", f"{f.name} is not {f.type}: {str(e).splitlines()[0]}"
        return "", "not JSON", "not one JSON object"


def _required_missing(table: pa.Table, fields: pa.Schema) -> str | None:
    """The first required field (not nullable) with a null in `table`, or None."""
    for f in fields:
        if not f.nullable and table[f.name].null_count:
            return f.name
    return None


class CsvValues(Values):
    def __init__(self, fields: pa.Schema):
        self.fields = fields
        self._read = pacsv.ReadOptions(column_names=fields.names, block_size=JSON_BLOCK)
        self._convert = pacsv.ConvertOptions(
            column_types=fields, strings_can_be_null=True, null_values=[""]
        )  # as files

    def read(self, values: list[bytes]) -> pa.Table | None:
        """The values, one CSV line each, read at once; None if one is not a line of the declared cells (a line
        break inside a value would shift every row after it, so it fails the batch too)."""
        text = b"\n".join(values)
        if text.count(b"\n") != len(values) - 1 or b"\r" in text or not min(map(len, map(bytes.strip, values))):
            return None
        try:
            table = pacsv.read_csv(pa.BufferReader(text), read_options=self._read, convert_options=self._convert)
        except pa.ArrowInvalid:
            return None
        if table.num_rows != len(values) or _required_missing(table, self.fields):
            return None
        return table

    def why(self, value: bytes) -> tuple[str, str, str]:
        if b"\n" in value or b"\r" in value or not value.strip():
            return "", "not CSV", "not one line" if value.strip() else "empty"
        try:
            cells = pacsv.read_csv(
                pa.BufferReader(value),
                read_options=pacsv.ReadOptions(column_names=self.fields.names),
                convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in self.fields.names}),
            )
        except pa.ArrowInvalid as e:
            return "", "not CSV", str(e).splitlines()[0]
        for f in self.fields:
            cell = cells[f.name][0].as_py()
            if cell in ("", None) and not f.nullable:
                return f.name, "missing column", f"{f.name} is empty"
            try:
                pa.array([cell], pa.string()).cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                return f.name, "wrong type", f"{f.name} is not {f.type}: {str(e).splitlines()[0]}"
        return "", "not CSV", "not one line of the declared cells"


def _long(v: int) -> bytes:
    """An Avro long: zig-zag, then base-128 little-endian."""
    v = (v << 1) ^ (v >> 63)
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        if not v:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _without_headers(body: bytes, values: list[bytes]) -> bytes | None:
    """The values joined in `body`, each without its Schema Registry header (magic byte 0, a 4-byte schema id),
    cut out on arrays; None if a value has none."""
    lengths = np.fromiter(map(len, values), np.int64, len(values))
    starts = np.cumsum(lengths) - lengths
    data = np.frombuffer(body, np.uint8)
    if (lengths < REGISTRY_HEADER).any() or data[starts].any():
        return None
    keep = np.ones(len(data), bool)
    keep[(starts[:, None] + np.arange(REGISTRY_HEADER)).ravel()] = False
    return data[keep].tobytes()


class AvroValues(Values):
    """Read by polars a batch at once; a batch it cannot read is looked through datum by datum with fastavro (the
    error path: polars panics on some bad bytes, once per read, and only names the first fault)."""

    def __init__(self, fields: pa.Schema, schema_file: str, header: bool, where: str):
        try:
            import fastavro
            import polars  # noqa: F401  (both are the avro extra: pip install 'streamjoin[avro]')
        except ImportError:
            raise ConfigError(
                f"{where}.format: \"avro\" needs polars and fastavro: pip install 'streamjoin[avro]'"
            ) from None
        try:
            schema = json.loads(Path(schema_file).read_text())
            self._parsed = fastavro.parse_schema(schema)
        except (OSError, ValueError, fastavro.schema.SchemaParseException) as e:
            raise ConfigError(f"{where}.avro_schema: cannot read {schema_file!r} as an Avro schema: {e}") from None
        if not isinstance(schema, dict) or schema.get("type") != "record":
            raise ConfigError(f"{where}.avro_schema: {schema_file!r} is not an Avro record schema")
        names = {f.get("name") for f in schema.get("fields", [])}
        absent = [f.name for f in fields if f.name not in names]
        if absent:
            raise ConfigError(f"{where}.avro_schema: the record has no field {', '.join(absent)} (declared in schema)")
        self.fields, self.header = fields, header
        self._sync = os.urandom(16)
        meta = {"avro.schema": json.dumps(schema).encode(), "avro.codec": b"null"}
        self._head = (
            b"Obj\x01"
            + _long(len(meta))
            + b"".join(_long(len(k)) + k.encode() + _long(len(v)) + v for k, v in meta.items())
            + _long(0)
            + self._sync
        )

    def read(self, values: list[bytes]) -> pa.Table | None:
        """The values' datums framed as one block of an object container and read at once."""
        import polars
        from polars.exceptions import PanicException

        body = b"".join(values)
        if self.header:
            body = _without_headers(body, values)
            if body is None:
                return None
        block = self._head + _long(len(values)) + _long(len(body)) + body + self._sync
        try:
            table = polars.read_avro(io.BytesIO(block)).to_arrow()
            if table.num_rows != len(values):
                return None
            table = pa.table([table[f.name].cast(f.type) for f in self.fields], schema=self.fields)
        except (Exception, PanicException):  # noqa: BLE001 (polars' errors for bytes that are no datums)
            return None
        return None if _required_missing(table, self.fields) else table

    def why(self, value: bytes) -> tuple[str, str, str]:
        return self._fault(value) or ("", "not Avro", "fastavro reads it, polars does not")

    def _fault(self, value: bytes) -> tuple[str, str, str] | None:
        """What is wrong with one value (None: nothing), by fastavro."""
        import fastavro

        if self.header:
            if len(value) < REGISTRY_HEADER or value[0] != 0:
                return "", "not Avro", "no Schema Registry header (magic byte 0 and a 4-byte schema id)"
            value = value[REGISTRY_HEADER:]
        stream = io.BytesIO(value)
        try:
            datum = fastavro.schemaless_reader(stream, self._parsed, None)
        except Exception as e:  # noqa: BLE001 (any fault of the bytes)
            return "", "not Avro", f"{type(e).__name__}: {e}"[:200]
        if stream.tell() != len(value):
            return "", "not Avro", f"{len(value) - stream.tell()} bytes after the datum"
        for f in self.fields:
            if datum.get(f.name) is None:
                if not f.nullable:
                    return f.name, "missing column", f"{f.name} is null"
                continue
            try:
                pa.array([datum[f.name]]).cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                return f.name, "wrong type", f"{f.name} is not {f.type}: {str(e).splitlines()[0]}"
        return None

    def read_all(self, values: list[bytes]) -> tuple[list[tuple[int, pa.Table]], list[int]]:
        """One read; if it fails, each value looked at by fastavro and the runs between the bad ones read."""
        table = self.read(values)
        if table is not None:
            return [(0, table)], []
        bad = [i for i, v in enumerate(values) if self._fault(v) is not None]
        good: list[tuple[int, pa.Table]] = []
        for lo, hi in zip([0, *(i + 1 for i in bad)], [*bad, len(values)]):
            if hi > lo:
                halved(self.read, values, lo, hi, good, bad)  # read at once unless fastavro missed a fault
        return good, sorted(bad)


def value_reader(kafka: dict, fields: pa.Schema, where: str):
    """The reader of a stream's values by `kafka.format`."""
    if kafka.format == "csv":
        return CsvValues(fields)
    if kafka.format == "avro":
        return AvroValues(fields, kafka.avro_schema, kafka.registry_header, where)
    return JsonValues(fields)
