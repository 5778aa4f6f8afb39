"""Event time inside the engine: int64 microseconds since the epoch (docs/time.md).

Seconds are converted once, where they enter: input files, the generator and config durations.  Every
comparison after that (lateness, join, expiry, watermarks, punctuations, aggregation windows) is an
integer comparison, so a pair exactly `join.window` apart joins in the join test and in expiry alike.
Results leave in seconds again (`to_seconds`), the float64 nearest to the microseconds, which is the
float64 of the decimals the user wrote.

Microseconds, not nanoseconds: a float64 second count resolves a microsecond until 2242 (not a
nanosecond today), int64 microseconds leave room for the sentinels below and for `ts +- window` without
overflow, and they are Spark's timestamp precision.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

import numpy as np

PER_SECOND = 1_000_000
#: a valid ts lies strictly within +-TS_LIMIT (about 73,000 years around 1970), a duration below DURATION_LIMIT:
#: sums and differences of a ts, a window and a delay stay far from int64's ends
TS_LIMIT = 1 << 61
DURATION_LIMIT = 1 << 60
#: below / above every valid ts, even after subtracting or adding a window and a delay (was -inf / +inf)
NEG_INF = -(1 << 62)
POS_INF = 1 << 62
#: a message header that carries no watermark (was NaN)
NONE = int(np.iinfo(np.int64).min)

#: source.ts_unit -> digits of the unit below a second (also the units of Arrow timestamp columns)
UNITS = {"s": 0, "ms": 3, "us": 6, "ns": 9}
#: ISO-8601 as text: a date, then optionally a time (seconds and fraction optional) and a zone (Z, +hh, +hhmm,
#: +hh:mm); without a zone it is UTC
ISO_TEXT = (
    r"^(?P<date>[0-9]{4}-[0-9]{2}-[0-9]{2})"
    r"(?:[Tt ](?P<hm>[0-9]{2}:[0-9]{2})(?::(?P<sec>[0-9]{2})(?:[.,](?P<frac>[0-9]+))?)?)?"
    r"\s*(?:[Zz]|(?P<sign>[+-])(?P<zh>[0-9]{2})(?::?(?P<zm>[0-9]{2}))?)?$"
)
#: a number as text (case aside), what a float64 parse accepts: the file source's rule for ts and value
FLOAT_TEXT = r"^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|nan|inf|infinity)$"
_LARGEST = str(TS_LIMIT // PER_SECOND)  #: whole seconds beyond this are out of range (and would overflow)


def duration(seconds: float) -> int:
    """A config duration in microseconds, from the decimals as written (the shortest repr of the float)."""
    return int(Decimal(repr(float(seconds))).scaleb(6).to_integral_value(ROUND_HALF_EVEN))


def valid(ticks: np.ndarray) -> np.ndarray:
    """Within +-TS_LIMIT (two comparisons: abs of int64's minimum overflows)."""
    return (ticks > -TS_LIMIT) & (ticks < TS_LIMIT)


def from_seconds(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(microseconds, ok) of float64 seconds (`from_numbers` in seconds)."""
    return from_numbers(seconds, "s")


def from_numbers(x: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(microseconds, ok) of float64 numbers of `unit` (UNITS): rounded to the nearest microsecond; not ok if
    NaN, infinite or out of range.  Whole units and the fraction are converted apart, so the product adds no
    error: the float64 of a decimal with up to 6 decimals (seconds) converts to exactly those decimals while
    |ts| < 2**33 s.  Nanoseconds are divided (a float64 holds no nanosecond of today's dates anyway)."""
    x = np.asarray(x, dtype=np.float64)
    per_unit = 10.0 ** (6 - UNITS[unit])  # microseconds per unit
    ok = np.isfinite(x) & (np.abs(x) < TS_LIMIT / per_unit)
    x = np.where(ok, x, 0.0)
    if per_unit < 1:
        ticks = np.rint(x / 1000.0).astype(np.int64)
    else:
        whole = np.floor(x)
        ticks = whole.astype(np.int64) * int(per_unit) + np.rint((x - whole) * per_unit).astype(np.int64)
    ok &= valid(ticks)
    return np.where(ok, ticks, 0), ok


def from_integers(x: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(microseconds, ok) of int64 counts of `unit` (an integer or an Arrow timestamp column); nanoseconds
    are rounded to the microsecond half to even."""
    x = np.asarray(x, dtype=np.int64)
    if unit == "ns":
        q, r = np.divmod(x, 1000)  # floor division: 0 <= r < 1000 on either side of zero
        ticks = q + ((r > 500) | ((r == 500) & (q % 2 == 1)))
        return ticks, valid(ticks)
    per_unit = 10 ** (6 - UNITS[unit])
    ok = (x > -(TS_LIMIT // per_unit)) & (x < TS_LIMIT // per_unit)
    return np.where(ok, x, 0) * per_unit, ok


def _with_fraction(ticks: np.ndarray, frac) -> np.ndarray:
    """`ticks` (whole seconds in microseconds) plus the decimal digits `frac` of a second (strings, null or
    empty = none), rounded to the microsecond half to even."""
    import pyarrow as pa
    import pyarrow.compute as pc

    frac = pc.utf8_rpad(pc.fill_null(frac, ""), 7, "0")
    micro = pc.cast(pc.utf8_slice_codeunits(frac, 0, 6), pa.int64()).to_numpy()
    seventh = pc.cast(pc.utf8_slice_codeunits(frac, 6, 7), pa.int64()).to_numpy()
    beyond = _ok(pc.match_substring_regex(pc.utf8_slice_codeunits(frac, 7, 1 << 30), "[1-9]"))
    ticks = ticks + micro
    return ticks + ((seventh > 5) | ((seventh == 5) & (beyond | (ticks % 2 == 1))))


def from_decimal_text(text, unit: str = "s") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(microseconds, is a number, ok) of trimmed decimal strings of `unit`, exactly as written: "1.001" (s)
    is 1_001_000, "1700000000123456789" (ns) is 1_700_000_000_123_457.

    Plain decimals ([+-]digits[.digits]) are converted digit by digit (the decimal point moved to seconds),
    rounded to the microsecond half to even; others that are numbers (exponents, nan, inf) go through
    float64 (`from_numbers`).  `text`: a pyarrow string array (pyarrow is imported here, not with the
    module: Spark's Python workers import protocol.config, hence this module, without it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pa.chunked_array([text]) if isinstance(text, pa.Array) else text
    parts = pc.extract_regex(text, r"^(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?$")
    whole, frac = pc.struct_field(parts, "int"), pc.struct_field(parts, "frac")
    plain = _ok(pc.and_(pc.is_valid(parts), pc.greater(pc.add(pc.utf8_length(whole), pc.utf8_length(frac)), 0)))
    whole, frac = pc.fill_null(whole, ""), pc.fill_null(frac, "")
    if shift := UNITS[unit]:  # "1500" ms is "1.500" s
        whole = pc.utf8_lpad(whole, shift, "0")
        frac = pc.binary_join_element_wise(pc.utf8_slice_codeunits(whole, -shift, 1 << 30), frac, "")
        whole = pc.utf8_slice_codeunits(whole, 0, -shift)
    whole = pc.replace_substring_regex(whole, r"^0+", "")
    length = pc.utf8_length(whole)
    fits = _ok(
        pc.or_(pc.less(length, len(_LARGEST)), pc.and_(pc.equal(length, len(_LARGEST)), pc.less_equal(whole, _LARGEST)))
    )
    take = pa.array(plain & fits)
    whole = pc.if_else(take, whole, "0")
    whole = pc.if_else(pc.equal(whole, ""), "0", whole)
    ticks = _with_fraction(pc.cast(whole, pa.int64()).to_numpy() * PER_SECOND, pc.if_else(take, frac, ""))
    ticks = np.where(_ok(pc.equal(pc.struct_field(parts, "sign"), "-")), -ticks, ticks)
    ok = plain & fits & valid(ticks)
    # not plain: an exponent, nan or inf, or a plain decimal too large (then out of range either way)
    other = ~plain
    number = plain.copy()
    if other.any():
        floats = _ok(pc.match_substring_regex(text, FLOAT_TEXT, ignore_case=True))
        number |= other & floats
        parsed = pc.cast(pc.if_else(pa.array(other & floats), text, "0"), pa.float64()).to_numpy()
        f_ticks, f_ok = from_numbers(parsed, unit)
        ticks = np.where(other, f_ticks, ticks)
        ok = np.where(other, other & floats & f_ok, ok)
    return np.where(ok, ticks, 0), number, ok


def from_iso_text(text) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(microseconds, is ISO-8601, ok) of trimmed strings (ISO_TEXT): the date and time through Arrow's
    strptime, kept only where formatting it again gives the same text (strptime takes "02-30" as "03-02"),
    the fraction digit by digit rounded half to even, minus the zone's offset."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = pc.extract_regex(text, ISO_TEXT)
    iso = _ok(pc.is_valid(parts))
    field = lambda name: pc.fill_null(pc.struct_field(parts, name), "")
    hm, sec = field("hm"), field("sec")
    stamp = pc.binary_join_element_wise(
        field("date"), "T", pc.if_else(pc.equal(hm, ""), "00:00", hm), ":", pc.if_else(pc.equal(sec, ""), "00", sec), ""
    )
    fmt = "%Y-%m-%dT%H:%M:%S"
    local = pc.strptime(stamp, format=fmt, unit="s", error_is_null=True)
    ok = iso & _ok(pc.equal(pc.strftime(local, format=fmt), stamp))
    seconds = pc.fill_null(pc.cast(local, pa.int64()), 0).to_numpy()
    zh, zm = (pc.cast(pc.if_else(pc.equal(z, ""), "0", z), pa.int64()).to_numpy() for z in (field("zh"), field("zm")))
    ok &= (zh < 24) & (zm < 60)
    offset = np.where(_ok(pc.equal(field("sign"), "-")), -1, 1) * (zh * 3600 + zm * 60)
    ticks = _with_fraction(np.where(ok, seconds - offset, 0) * PER_SECOND, field("frac"))
    ok &= valid(ticks)
    return np.where(ok, ticks, 0), iso, ok


def from_column(col, unit: str = "s") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(microseconds, is a time, finite, ok) of an input file's ts column (common.stream_file; a pyarrow
    ChunkedArray): Arrow timestamps in their own unit (UTC), integer columns as counts of `unit`, float
    columns rounded to the microsecond (`from_numbers`), text, decimal and date columns from their digits
    (`from_decimal_text` in `unit`, else `from_iso_text`); nulls and other types are not times."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = col.type
    present = _ok(pc.is_valid(col))
    if pa.types.is_timestamp(t) or (pa.types.is_integer(t) and t != pa.uint64()):
        ticks, ok = from_integers(
            pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(), t.unit if pa.types.is_timestamp(t) else unit
        )
        return ticks, present, present, ok & present
    if pa.types.is_floating(t):
        x = pc.fill_null(pc.cast(col, pa.float64()), np.nan).to_numpy()
        ticks, ok = from_numbers(x, unit)
        return ticks, present, present & np.isfinite(x), ok & present
    try:
        text = pc.utf8_trim_whitespace(col if pa.types.is_string(t) else pc.cast(col, pa.string()))
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        text = pa.chunked_array([pa.nulls(len(col), pa.string())])
    ticks, number, ok = from_decimal_text(text, unit)
    finite = number & ~_ok(pc.match_substring_regex(text, "(nan|inf)", ignore_case=True))
    if not number.all():
        i_ticks, iso, i_ok = from_iso_text(text)
        ticks, ok = np.where(iso, i_ticks, ticks), np.where(iso, i_ok, ok)
        number, finite = number | i_ok, finite | i_ok  # an ISO time is never out of range: a bad one is no time
    return ticks, number, finite, ok


def _ok(mask) -> np.ndarray:
    import pyarrow.compute as pc

    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def to_seconds(ticks: np.ndarray) -> np.ndarray:
    """Microseconds as float64 seconds (the user's time in results and late/): the float64 nearest to them."""
    return np.asarray(ticks) / PER_SECOND


def bound_seconds(ticks: int) -> float:
    """A watermark or punctuation in seconds; the sentinels (and anything beyond them) as -inf / +inf."""
    return -np.inf if ticks <= NEG_INF else np.inf if ticks >= POS_INF else ticks / PER_SECOND
