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
    """(microseconds, ok) of float64 seconds: rounded to the nearest microsecond; not ok if NaN, infinite or
    out of range.  Whole seconds and the fraction are converted apart, so the product adds no error: the
    float64 of a decimal with up to 6 decimals converts to exactly those decimals while |ts| < 2**33 s."""
    x = np.asarray(seconds, dtype=np.float64)
    ok = np.isfinite(x) & (np.abs(x) < TS_LIMIT / PER_SECOND)
    x = np.where(ok, x, 0.0)
    whole = np.floor(x)
    ticks = whole.astype(np.int64) * PER_SECOND + np.rint((x - whole) * PER_SECOND).astype(np.int64)
    ok &= valid(ticks)
    return np.where(ok, ticks, 0), ok


def from_integer_seconds(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(microseconds, ok) of whole seconds (an integer column)."""
    s = np.asarray(seconds, dtype=np.int64)
    ok = (s > -(TS_LIMIT // PER_SECOND)) & (s < TS_LIMIT // PER_SECOND)
    return np.where(ok, s, 0) * PER_SECOND, ok


def from_decimal_text(text) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(microseconds, is a number, ok) of trimmed decimal strings, exactly as written: "1.001" is 1_001_000.

    Plain decimals ([+-]digits[.digits]) are converted digit by digit, rounded to the microsecond half to
    even; others that are numbers (exponents, nan, inf) go through float64 (`from_seconds`).  `text`: a
    pyarrow string array (pyarrow is imported here, not with the module: Spark's Python workers import
    protocol.config, hence this module, without it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pa.chunked_array([text]) if isinstance(text, pa.Array) else text
    parts = pc.extract_regex(text, r"^(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?$")
    whole, frac = pc.struct_field(parts, "int"), pc.struct_field(parts, "frac")
    plain = _ok(pc.and_(pc.is_valid(parts), pc.greater(pc.add(pc.utf8_length(whole), pc.utf8_length(frac)), 0)))
    whole = pc.replace_substring_regex(pc.fill_null(whole, ""), r"^0+", "")
    length = pc.utf8_length(whole)
    fits = _ok(pc.or_(pc.less(length, len(_LARGEST)),
                      pc.and_(pc.equal(length, len(_LARGEST)), pc.less_equal(whole, _LARGEST))))
    take = pa.array(plain & fits)
    whole = pc.if_else(take, whole, "0")
    whole = pc.if_else(pc.equal(whole, ""), "0", whole)
    frac = pc.utf8_rpad(pc.if_else(take, pc.fill_null(frac, ""), ""), 7, "0")
    micro = pc.cast(pc.utf8_slice_codeunits(frac, 0, 6), pa.int64()).to_numpy()
    seventh = pc.cast(pc.utf8_slice_codeunits(frac, 6, 7), pa.int64()).to_numpy()
    beyond = _ok(pc.match_substring_regex(pc.utf8_slice_codeunits(frac, 7, 1 << 30), "[1-9]"))
    ticks = pc.cast(whole, pa.int64()).to_numpy() * PER_SECOND + micro
    ticks += (seventh > 5) | ((seventh == 5) & (beyond | (ticks % 2 == 1)))  # half to even
    ticks = np.where(_ok(pc.equal(pc.struct_field(parts, "sign"), "-")), -ticks, ticks)
    ok = plain & fits & valid(ticks)
    # not plain: an exponent, nan or inf, or a plain decimal too large (then out of range either way)
    other = ~plain
    number = plain.copy()
    if other.any():
        floats = _ok(pc.match_substring_regex(text, FLOAT_TEXT, ignore_case=True))
        number |= other & floats
        parsed = pc.cast(pc.if_else(pa.array(other & floats), text, "0"), pa.float64()).to_numpy()
        f_ticks, f_ok = from_seconds(parsed)
        ticks = np.where(other, f_ticks, ticks)
        ok = np.where(other, other & floats & f_ok, ok)
    return np.where(ok, ticks, 0), number, ok


def from_column(col) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(microseconds, is a number, finite, ok) of an input file's ts column (master.source; a pyarrow
    ChunkedArray): text (CSV) and decimal columns from their digits (`from_decimal_text`), float columns
    rounded to the microsecond (`from_seconds`), integer columns as whole seconds; nulls and other types are
    not numbers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = col.type
    present = _ok(pc.is_valid(col))
    if pa.types.is_integer(t) and t != pa.uint64():
        ticks, ok = from_integer_seconds(pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy())
        return ticks, present, present, ok & present
    if pa.types.is_floating(t):
        x = pc.fill_null(pc.cast(col, pa.float64()), np.nan).to_numpy()
        ticks, ok = from_seconds(x)
        return ticks, present, present & np.isfinite(x), ok & present
    try:
        text = pc.utf8_trim_whitespace(col if pa.types.is_string(t) else pc.cast(col, pa.string()))
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        text = pa.chunked_array([pa.nulls(len(col), pa.string())])
    ticks, number, ok = from_decimal_text(text)
    finite = number & ~_ok(pc.match_substring_regex(text, "(nan|inf)", ignore_case=True))
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
