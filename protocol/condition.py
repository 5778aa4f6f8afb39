"""A query's conditions evaluated on whole arrays (protocol.query): a stream's filter and terms on its rows' Arrow
columns where they are read, the pair condition on the terms of candidate pairs on the slaves.

SQL's three-valued logic throughout: a comparison with a NULL operand is NULL, AND / OR / NOT are Kleene's, and a
row or a pair passes only where the whole condition is TRUE.  A term travels as the bits of a 64-bit float in one
word of the tuple (protocol.tuples: the `terms` words), the last word holding a bit per term that is NULL.
"""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from protocol.query import Col, Lit, Node, Term

_ARROW = {
    "eq": pc.equal,
    "ne": pc.not_equal,
    "lt": pc.less,
    "le": pc.less_equal,
    "gt": pc.greater,
    "ge": pc.greater_equal,
    "add": pc.add,
    "sub": pc.subtract,
    "mul": pc.multiply,
}
_NUMPY = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
}


class ConditionError(Exception):
    """A condition that the columns' types do not admit (text where a number is needed, say)."""


# -- on a stream's rows (Arrow) -------------------------------------------------------------------------------
def arrow_value(node: Node, table: pa.Table):
    """`node` over the rows of `table` (its columns under the stream's own names): an Arrow array or scalar."""
    if isinstance(node, Col):
        return table[node.name]
    if isinstance(node, Lit):
        if node.interval:
            return pa.scalar(datetime.timedelta(microseconds=node.value), pa.duration("us"))
        return pa.scalar(node.value)
    if isinstance(node, Term):
        raise TypeError("a term is evaluated on pairs (pair_mask)")
    args = [arrow_value(a, table) for a in node.args]
    op = node.op
    try:
        if op in _ARROW:
            return _ARROW[op](*args)
        if op == "div":  # SQL's / divides as decimals or floats, never as integers
            return pc.divide(*(pc.cast(a, pa.float64()) if _integer(a) else a for a in args))
        if op == "and":
            return pc.and_kleene(*args)
        if op == "or":
            return pc.or_kleene(*args)
        if op == "not":
            return pc.invert(args[0])
        if op == "neg":
            return pc.negate(args[0])
        if op == "abs":
            return pc.abs(args[0])
        if op == "is_null":
            return pc.is_null(args[0])
        if op == "in":  # NULL IN (...) is NULL
            x, values = args[0], pa.array([a.as_py() for a in args[1:]])
            return pc.if_else(pc.is_valid(x), pc.is_in(x, value_set=values.cast(x.type, safe=False)), None)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ConditionError(f"{str(e).splitlines()[0]}") from None
    raise ValueError(f"unknown operation {op!r}")


def _integer(a) -> bool:
    return pa.types.is_integer(a.type)


def row_mask(node: Node, table: pa.Table) -> np.ndarray:
    """Rows of `table` where `node` is TRUE."""
    v = arrow_value(node, table)
    if isinstance(v, pa.Scalar):
        return np.full(table.num_rows, v.as_py() is True)
    if not pa.types.is_boolean(v.type):
        raise ConditionError(f"a filter must be a condition, got a value of type {v.type}")
    return np.asarray(pc.fill_null(v, False).to_numpy(zero_copy_only=False), dtype=bool)


def term_words(terms: tuple[Node, ...], table: pa.Table, words: int) -> np.ndarray:
    """The stream's terms over the rows of `table` as `words` int64 words a row: each term's value as a float64's
    bits (timestamps and intervals in microseconds, booleans 0/1), the last word a bit per NULL term."""
    n = table.num_rows
    out = np.zeros((n, words), np.int64)
    nulls = np.zeros(n, np.uint64)
    for i, t in enumerate(terms):
        v = arrow_value(t, table)
        if isinstance(v, pa.Scalar):
            v = pa.array([v.as_py()] * n, v.type)
        if isinstance(v, pa.ChunkedArray):
            v = v.combine_chunks()
        values = _as_float(v)
        out[:, i] = values.view(np.int64)
        nulls |= np.asarray(pc.is_null(v).to_numpy(zero_copy_only=False), bool).astype(np.uint64) << np.uint64(i)
    if words:
        out[:, words - 1] = nulls.view(np.int64)
    return out


def _as_float(v: pa.Array) -> np.ndarray:
    t = v.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        v = pc.cast(pc.cast(v, pa.timestamp("us", getattr(t, "tz", None))), pa.int64())
    elif pa.types.is_duration(t):
        v = pc.cast(pc.cast(v, pa.duration("us")), pa.int64())
    elif pa.types.is_boolean(t):
        v = pc.cast(v, pa.int8())
    elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise ConditionError(
            f"a condition on the pair compares numbers, times and booleans across the streams, not {t}: "
            "make a text column part of the key, or filter it on its own stream"
        )
    return np.asarray(pc.fill_null(pc.cast(v, pa.float64()), 0.0).to_numpy(zero_copy_only=False), np.float64)


# -- on pairs (numpy) ---------------------------------------------------------------------------------------------
def pair_mask(node: Node, r: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Pairs whose condition is TRUE; `r`, `s`: the (pairs, words) term words of each pair's R and S tuple."""
    value, null = _pair(node, (r, s), len(r))
    return np.asarray(value, bool) & ~null


def _pair(node: Node, words: tuple[np.ndarray, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, null) of `node` over n pairs: floats, or booleans for a condition."""
    if isinstance(node, Term):
        w = words[node.side]
        bits = w[:, -1].view(np.uint64) >> np.uint64(node.index) & np.uint64(1)
        return np.ascontiguousarray(w[:, node.index]).view(np.float64), bits.astype(bool)
    if isinstance(node, Lit):
        v = node.value
        if v is None:
            return np.zeros(n), np.ones(n, bool)
        return np.full(n, float(v)), np.zeros(n, bool)
    if isinstance(node, Col):
        raise TypeError("a pair condition reads terms (protocol.query.QueryPlan.terms), not columns")
    args = [_pair(a, words, n) for a in node.args]
    op = node.op
    if op == "and" or op == "or":
        (a, an), (b, bn) = args
        a, b = a.astype(bool), b.astype(bool)
        if op == "and":
            false = (~a & ~an) | (~b & ~bn)
            return a & b & ~an & ~bn, ~false & (an | bn)
        true = (a & ~an) | (b & ~bn)
        return true, ~true & (an | bn)
    if op == "not":
        return ~args[0][0].astype(bool), args[0][1]
    if op == "is_null":
        return args[0][1].copy(), np.zeros(n, bool)
    if op == "neg":
        return -args[0][0], args[0][1]
    if op == "abs":
        return np.abs(args[0][0]), args[0][1]
    if op == "in":
        (x, xn), rest = args[0], args[1:]
        hit = np.zeros(n, bool)
        for v, vn in rest:
            hit |= (x == v) & ~vn
        some_null = np.logical_or.reduce([vn for _, vn in rest]) if rest else np.zeros(n, bool)
        return hit, xn | (~hit & some_null)
    (a, an), (b, bn) = args
    with np.errstate(divide="ignore", invalid="ignore"):
        out = _NUMPY[op](a, b)
    null = an | bn
    if op == "div":
        null = null | (b == 0)  # Spark: division by zero is NULL
    return out, null
