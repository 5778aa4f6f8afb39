"""The join as a query: Spark SQL over the two declared streams, compiled once into a typed plan (docs/query.md).

`compile_query` parses the query with sqlglot (Spark's dialect) and splits it the way a streaming interval join
needs it: the key equalities (hash partitioning), the bounds on the two event times (the window and the
watermark's expiry), a band or less predicate when there is no equality (key ranges), the filters on one stream
(they run where its rows are read, before a row is buffered) and the rest, a condition on the pair (it runs on
the slaves, on the arrays of candidate pairs, before a pair is emitted or flags its rows matched).  What a
streaming interval join cannot do is refused with the clause named.

The query's outer join is simplified as an optimizer does: a WHERE conjunct that can never be true with one
side's columns all null removes that side's null rows, so the join on the other side becomes inner there
(LEFT + WHERE on S: INNER; FULL + WHERE on R: LEFT).  Then a filter on one stream runs at ingest where SQL allows
it: in WHERE on a side whose rows the join keeps, in ON on the null-supplying side (and either side of an inner
join); a condition in ON on a side the join keeps decides pairs only, so it stays with the pair condition.

A condition on the pair sees its single-stream parts as *terms*: each maximal piece that names one stream only
(`t.price * 1.01`, `q.src = 'X'`) is computed where the row is read, with Arrow's types, and travels with the
tuple as one 64-bit float (timestamps as microseconds, booleans as 0/1, decimals rounded to a double: exact for
integers and times below 2**53, decimals to 15 digits) beside a null bit; the pair condition combines the
terms of both sides with SQL's three-valued logic (protocol.condition).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from protocol.errors import ConfigError

R, S = 0, 1
#: the engine's own result columns a SELECT may name unqualified
ENGINE_COLUMNS = ("kind", "delay")
_JOIN_TYPES = {
    (None, None): "inner",
    (None, "INNER"): "inner",
    ("LEFT", None): "left",
    ("LEFT", "OUTER"): "left",
    ("RIGHT", None): "right",
    ("RIGHT", "OUTER"): "right",
    ("FULL", None): "full",
    ("FULL", "OUTER"): "full",
    ("LEFT", "SEMI"): "semi",
    (None, "SEMI"): "semi",
    ("LEFT", "ANTI"): "anti",
    (None, "ANTI"): "anti",
}
#: the sides whose rows a join type keeps whatever the other side holds (a condition on them alone decides pairs)
PRESERVED = {"inner": (), "left": (R,), "right": (S,), "full": (R, S), "semi": (R,), "anti": (R,)}
#: after a WHERE removes a side's null rows: join type -> side -> the join type it becomes
_NULL_REJECTED = {"left": {S: "inner"}, "right": {R: "inner"}, "full": {R: "left", S: "right"}}
_UNITS_US = {
    "microsecond": 1,
    "millisecond": 1_000,
    "second": 1_000_000,
    "minute": 60_000_000,
    "hour": 3_600_000_000,
    "day": 86_400_000_000,
}
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
_FLIPPED = {"eq": "eq", "ne": "ne", "lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


# -- the expression tree ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Col:
    """A stream's column: `side` R (0) or S (1)."""

    side: int
    name: str


@dataclass(frozen=True)
class Lit:
    """A constant: a number, text, a boolean, None (NULL), or an interval (`interval` True: microseconds)."""

    value: Any
    interval: bool = False


@dataclass(frozen=True)
class Term:
    """A pair condition's leaf: the `index`-th term of a side (a single-stream piece computed at ingest)."""

    side: int
    index: int


@dataclass(frozen=True)
class Call:
    """An operation: and, or, not, eq, ne, lt, le, gt, ge, add, sub, mul, div, neg, abs, is_null, in (its first
    argument among the constants that follow)."""

    op: str
    args: tuple


Node = Col | Lit | Term | Call


def sides(node: Node) -> set[int]:
    if isinstance(node, (Col, Term)):
        return {node.side}
    if isinstance(node, Call):
        return set().union(*(sides(a) for a in node.args))
    return set()


def columns(node: Node | None) -> list[Col]:
    """The columns a tree names, each once, in order of appearance."""
    if node is None:
        return []
    if isinstance(node, Col):
        return [node]
    if isinstance(node, Call):
        return list(dict.fromkeys(c for a in node.args for c in columns(a)))
    return []


def text(node: Node, names: tuple[str, str] = ("r", "s")) -> str:
    """The tree as SQL-like text, columns named by their stream (`explain`, messages)."""
    if isinstance(node, Col):
        return f"{names[node.side]}.{node.name}"
    if isinstance(node, Term):
        return f"{names[node.side]}#{node.index}"
    if isinstance(node, Lit):
        if node.interval:
            return f"INTERVAL {node.value} MICROSECONDS"
        return "NULL" if node.value is None else repr(node.value) if isinstance(node.value, str) else str(node.value)
    a = [text(x, names) for x in node.args]
    infix = {"and": "AND", "or": "OR", "eq": "=", "ne": "<>", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
    infix |= {"add": "+", "sub": "-", "mul": "*", "div": "/"}
    if node.op in infix:
        return f"({f' {infix[node.op]} '.join(a)})"
    if node.op == "not":
        return f"NOT {a[0]}"
    if node.op == "neg":
        return f"-{a[0]}"
    if node.op == "is_null":
        return f"{a[0]} IS NULL"
    if node.op == "in":
        return f"{a[0]} IN ({', '.join(a[1:])})"
    return f"{node.op.upper()}({', '.join(a)})"


def conjunction(parts: list[Node]) -> Node | None:
    out = None
    for p in parts:
        out = p if out is None else Call("and", (out, p))
    return out


def can_be_true(node: Node, null_side: int) -> bool:
    """Whether `node` can be TRUE when every column of `null_side` is NULL (False: the conjunct removes that
    side's null rows, SQL's null rejection), by the values each sub-tree can take."""
    return "T" in _possible(node, null_side)


def _possible(node: Node, null_side: int) -> frozenset:
    """The values a sub-tree can take: T, F, N (NULL) for a condition, V or N for a value."""
    if isinstance(node, (Col, Term)):
        return frozenset("N") if node.side == null_side else frozenset("VN")
    if isinstance(node, Lit):
        return frozenset("N") if node.value is None else frozenset("TF" if isinstance(node.value, bool) else "V")
    args = [_possible(a, null_side) for a in node.args]
    if node.op == "is_null":
        return frozenset(("T" if "N" in args[0] else "") + ("F" if args[0] - {"N"} else ""))
    if node.op == "not":
        return frozenset({"T": "F", "F": "T", "N": "N"}[v] for v in args[0])
    if node.op in ("and", "or"):
        out = args[0]
        for nxt in args[1:]:
            out = frozenset(_kleene(node.op, a, b) for a in out for b in nxt)
        return out
    can_null = any("N" in a for a in args)
    all_values = all(a - {"N"} for a in args)
    if node.op in COMPARISONS or node.op == "in":
        return frozenset(("TF" if all_values else "") + ("N" if can_null else ""))
    return frozenset(("V" if all_values else "") + ("N" if can_null else ""))


def _kleene(op: str, a: str, b: str) -> str:
    a, b = ("T" if v == "V" else v for v in (a, b))
    if op == "and":
        return "F" if "F" in (a, b) else "N" if "N" in (a, b) else "T"
    return "T" if "T" in (a, b) else "N" if "N" in (a, b) else "F"


# -- the plan ---------------------------------------------------------------------------------------------------
class Grouping(NamedTuple):
    """A query's GROUP BY, as `[aggregate]` says it (protocol.aggregation): the group columns, the window's column,
    length and slide (microseconds; 0: no window) and the measures (fn, side, column; count's column None)."""

    groups: tuple[tuple[int, str], ...]
    time: tuple[int, str] | None
    window: int
    slide: int
    measures: tuple[tuple[str, int | None, str | None], ...]


class StreamQuery(NamedTuple):
    """A stream's part of a query: its filter (None: every row), its terms and the words a tuple has for them."""

    filter: Node | None
    terms: tuple
    words: int
    columns: tuple[str, ...]  #: every column of the stream the query names


@dataclass(frozen=True)
class QueryPlan:
    """What a query means for the engine.  Times in integer microseconds; `lower <= s.ts - r.ts <= upper` with
    open ends already moved to the next microsecond inside (`open` says which were open)."""

    sql: str
    streams: tuple[str, str]  #: the stream names of R (FROM) and S (JOIN)
    aliases: tuple[str, str]
    join_type: str
    keys: tuple[tuple[str, str], ...]  #: (R's column, S's column) per key component
    time: tuple[str, str]  #: each stream's event-time column
    lower: int
    upper: int
    open: tuple[bool, bool]  #: whether the query's lower / upper bound was strict
    predicate: str  #: "equal", "band" or "less" (no equality: key ranges)
    band: int
    filters: tuple[Node | None, Node | None]  #: per stream, run where its rows are read
    terms: tuple[tuple[Node, ...], tuple[Node, ...]]  #: per stream, its pieces of the pair condition
    condition: Node | None  #: on the pair, over Term leaves and constants
    projection: tuple[tuple[str, int | None, str], ...] | None  #: (result name, side or None, column); None: *
    notes: tuple[str, ...] = field(default=())  #: how the query was rewritten
    aggregate: Grouping | None = None  #: GROUP BY: the two-phase aggregation of the pairs (`[aggregate]`)

    @property
    def term_words(self) -> int:
        """Words a tuple carries for the pair condition: the larger side's terms, and one of null bits."""
        n = max(len(t) for t in self.terms)
        return n + 1 if n else 0

    def stream(self, side: int) -> StreamQuery:
        named = self.read_columns(side) + [c for _, s, c in self.projection or () if s == side]
        named += [key[side] for key in self.keys] + [self.time[side]]
        return StreamQuery(self.filters[side], self.terms[side], self.term_words, tuple(dict.fromkeys(named)))

    def read_columns(self, side: int) -> list[str]:
        """The stream's columns its filter and its terms read."""
        named = columns(conjunction([x for x in (self.filters[side], *self.terms[side]) if x is not None]))
        return list(dict.fromkeys(c.name for c in named))

    def explain(self) -> list[str]:
        names = self.aliases
        lower = f"{'>' if self.open[0] else '>='} {(self.lower - self.open[0]) / 1e6:g} s"
        upper = f"{'<' if self.open[1] else '<='} {(self.upper + self.open[1]) / 1e6:g} s"
        lines = [
            f"streams: R = {self.streams[0]} ({names[0]}), S = {self.streams[1]} ({names[1]})",
            f"join: {self.join_type}",
            "keys: "
            + (
                ", ".join(f"{names[0]}.{r} = {names[1]}.{s}" for r, s in self.keys)
                if self.predicate == "equal"
                else f"{self.predicate} on {names[0]}.{self.keys[0][0]}, {names[1]}.{self.keys[0][1]}"
                + (f" (|distance| <= {self.band})" if self.predicate == "band" else "")
            ),
            f"time: {names[1]}.{self.time[1]} - {names[0]}.{self.time[0]} {lower} and {upper}",
        ]
        for side in (R, S):
            f = self.filters[side]
            lines.append(f"at ingest, {self.streams[side]}: {text(f, names) if f is not None else '(every row)'}")
        if self.condition is not None:
            cond = text(self.condition, names)
            for side in (R, S):
                for i, t in enumerate(self.terms[side]):
                    cond = cond.replace(f"{names[side]}#{i}", text(t, names))
            lines.append(f"on pairs: {cond}")
        else:
            lines.append("on pairs: (none)")
        if self.projection is None:
            lines.append("columns: * (each stream's columns as <stream>_<column>)")
        else:
            cols = [f"{c if s is None else names[s] + '.' + c} AS {out}" for out, s, c in self.projection]
            lines.append("columns: " + ", ".join(cols))
        lines += [f"rewritten: {n}" for n in self.notes]
        return lines


@functools.lru_cache(maxsize=16)
def compile_query(sql: str, names: tuple[str, ...], times: tuple[str, ...] = ()) -> QueryPlan:
    """The plan of `sql` over the declared streams `names` (`times`: their declared time columns, "" where none,
    in the order of `names`)."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import ParseError

    try:
        trees = sqlglot.parse(sql, read="spark")
    except ParseError as e:
        raise ConfigError(f"query: not valid Spark SQL: {str(e).splitlines()[0]}") from None
    trees = [t for t in trees if t is not None]
    if len(trees) != 1:
        raise ConfigError(f"query: expected one SELECT statement, got {len(trees)}")
    return _Compiler(sql, trees[0], exp, names, dict(zip(names, times))).plan()


class _Compiler:
    def __init__(self, sql: str, tree, exp, names: tuple[str, ...], times: dict[str, str]):
        self.sql, self.tree, self.exp, self.names, self.declared_times = sql, tree, exp, names, times
        self.notes: list[str] = []

    # -- structure
    def plan(self) -> QueryPlan:
        exp, t = self.exp, self.tree
        if not isinstance(t, exp.Select):
            raise ConfigError(f"query: only SELECT ... FROM a JOIN b ON ... is a streaming join, got {t.key.upper()}")
        for arg, clause in (
            ("with", "WITH"),
            ("with_", "WITH"),
            ("distinct", "DISTINCT"),
            ("having", "HAVING"),
            ("order", "ORDER BY (an unbounded stream has no last row to sort by)"),
            ("limit", "LIMIT"),
            ("offset", "OFFSET"),
            ("qualify", "QUALIFY"),
        ):
            if t.args.get(arg):
                raise ConfigError(f"query: {clause} is not supported in a streaming join")
        joins = t.args.get("joins") or []
        if len(joins) != 1:
            raise ConfigError(f"query: a streaming join takes exactly two streams, got {len(joins) + 1} tables")
        join = joins[0]
        side, kind = join.args.get("side"), join.args.get("kind")
        side, kind = (side.upper() if side else None), (kind.upper() if kind else None)
        on = join.args.get("on")
        where = t.args.get("where")
        if join.args.get("using"):
            raise ConfigError("query: JOIN ... USING is not supported: write the key equality in ON")
        if kind == "CROSS" and not side:  # FROM a, b WHERE ...: an inner join whose ON is the WHERE
            kind, on, where = None, (where.this if where is not None else None), None
        if (side, kind) not in _JOIN_TYPES:
            raise ConfigError(f"query: {' '.join(filter(None, (side, kind)))} JOIN is not supported")
        if on is None:
            raise ConfigError("query: the join needs an ON with the key equality and the time bounds")
        join_type = _JOIN_TYPES[(side, kind)]
        tables = [self._table(t.args["from_"].this), self._table(join.this)]
        if tables[0][0] == tables[1][0]:
            raise ConfigError(f"query: stream {tables[0][0]} joined with itself: declare it twice under two names")
        self.streams = tuple(name for name, _ in tables)
        self.aliases = {alias: side for side, (_, alias) in enumerate(tables)}
        self.aliases |= {name: side for side, (name, _) in enumerate(tables) if name not in self.aliases}
        self.alias_names = tuple(alias for _, alias in tables)
        on_parts = _conjuncts(self._node(on.this if isinstance(on, exp.Paren) else on))
        where_parts = _conjuncts(self._node(where.this)) if where is not None else []
        join_type, where_pair = self._where(join_type, where_parts)
        keys, time, (lower, upper, strict), predicate, band, on_rest = self._on(on_parts)
        filters: list[list[Node]] = [[], []]
        pair: list[Node] = list(where_pair)
        for part in on_rest:
            s = sides(part)
            if len(s) == 1 and next(iter(s)) not in PRESERVED[join_type]:
                filters[next(iter(s))].append(part)
            else:
                pair.append(part)
        for part in where_parts:
            if len(sides(part)) == 1:
                filters[next(iter(sides(part)))].append(part)
        terms: tuple[list[Node], list[Node]] = ([], [])
        condition = self._terms(conjunction(pair), terms) if pair else None
        for c in _constants(condition):
            if isinstance(c.value, str):
                raise ConfigError(
                    f"query: the text {c.value!r} is compared across the streams: a condition on the pair "
                    "compares numbers, times and booleans (make a text column part of the key, or filter it on "
                    "its own stream)"
                )
        return QueryPlan(
            sql=self.sql,
            streams=self.streams,
            aliases=self.alias_names,
            join_type=join_type,
            keys=tuple(keys),
            time=time,
            lower=lower,
            upper=upper,
            open=strict,
            predicate=predicate,
            band=band,
            filters=tuple(conjunction(f) for f in filters),
            terms=(tuple(terms[R]), tuple(terms[S])),
            condition=condition,
            projection=None if self.tree.args.get("group") else self._projection(join_type),
            notes=tuple(self.notes),
            aggregate=self._grouping(join_type) if self.tree.args.get("group") else None,
        )

    def _table(self, node) -> tuple[str, str]:
        exp = self.exp
        if not isinstance(node, exp.Table) or node.args.get("db"):
            raise ConfigError(f"query: FROM and JOIN name declared streams, got {node.sql('spark')!r} (a subquery?)")
        name = node.name
        if name not in self.names:
            known = ", ".join(self.names) or "none: declare them as [streams.NAME]"
            raise ConfigError(f"query: table {name} is not a declared stream (streams: {known})")
        return name, node.alias or name

    def _where(self, join_type: str, parts: list[Node]) -> tuple[str, list[Node]]:
        """The join type once WHERE's null rejections are applied, and the WHERE conjuncts on both streams (the
        others, on one stream, become its filter: the caller's)."""
        for part in parts:
            s = sides(part)
            if not s:
                raise ConfigError(f"query: WHERE {text(part, self.alias_names)} names no stream's column")
            if join_type in ("semi", "anti") and S in s:
                raise ConfigError(
                    f"query: WHERE {text(part, self.alias_names)}: a {join_type} join's rows are "
                    f"{self.streams[R]}'s alone; put the condition on {self.streams[S]} in ON"
                )
            for null_side in (R, S):
                new = _NULL_REJECTED.get(join_type, {}).get(null_side)
                if new and null_side in s and not can_be_true(part, null_side):
                    self.notes.append(
                        f"{join_type} join -> {new}: WHERE {text(part, self.alias_names)} removes the rows "
                        f"whose {self.streams[null_side]} columns are null"
                    )
                    join_type = new
        nulls = {"left": {S}, "right": {R}, "full": {R, S}}.get(join_type, set())
        for part in parts:  # what still meets a null-supplying side's null rows
            for side in nulls & sides(part):
                raise ConfigError(
                    f"query: WHERE {text(part, self.alias_names)} may keep the rows of the {join_type} join "
                    f"whose {self.streams[side]} columns are null: not supported (an anti join keeps the rows "
                    "without a partner)"
                )
        return join_type, [p for p in parts if len(sides(p)) == 2]

    def _on(self, parts: list[Node]):
        """Keys, time columns, (lower, upper, open ends), predicate, band and the other conjuncts of ON."""
        time = self._time_columns(parts)
        lower, upper, strict = None, None, [False, False]
        keys, rest, ranges = [], [], []
        for part in parts:
            b = self._bound(part, time)
            if b is not None:
                for op, c in b:
                    if op in ("ge", "gt", "eq"):
                        lo = c + (op == "gt")
                        if lower is None or lo > lower:
                            lower, strict[0] = lo, op == "gt"
                    if op in ("le", "lt", "eq"):
                        hi = c - (op == "lt")
                        if upper is None or hi < upper:
                            upper, strict[1] = hi, op == "lt"
                continue
            if isinstance(part, Call) and part.op == "eq" and all(isinstance(a, Col) for a in part.args):
                a, b = part.args
                if {a.side, b.side} == {R, S}:
                    r, s = (a, b) if a.side == R else (b, a)
                    if (r.name, s.name) in keys:
                        continue
                    keys.append((r.name, s.name))
                    continue
            rng = _range(part)
            if rng is not None:
                ranges.append((part, rng))
            rest.append(part)
        if lower is None or upper is None:
            missing = "lower" if lower is None else "upper"
            raise ConfigError(
                f"query: ON bounds {self.alias_names[S]}.{time[S]} - {self.alias_names[R]}.{time[R]} with no "
                f"{missing} end: a streaming join needs both (e.g. {self.alias_names[S]}.{time[S]} BETWEEN "
                f"{self.alias_names[R]}.{time[R]} - INTERVAL 2 SECONDS AND {self.alias_names[R]}.{time[R]})"
            )
        if lower > upper:
            raise ConfigError("query: the time bounds in ON admit no pair (the lower end is above the upper)")
        predicate, band = "equal", 0
        if not keys:
            if not ranges:
                raise ConfigError(
                    "query: ON has no key equality (r.k = s.k) and no band (ABS(r.k - s.k) <= d) or "
                    "less (r.k < s.k) on a key: a streaming join partitions the streams by one of them"
                )
            part, (predicate, r, s, band) = ranges[0]
            rest.remove(part)
            keys = [(r, s)]
        return keys, time, (lower, upper, tuple(strict)), predicate, band, rest

    def _time_columns(self, parts: list[Node]) -> tuple[str, str]:
        """Each stream's event-time column: as declared, else the columns ON compares with an INTERVAL."""
        found: list[set[str]] = [set(), set()]
        for part in parts:
            for cmp in _comparisons(part):
                lins = [_linear(a) for a in cmp.args]
                if None in lins or {c.side for c, _, _ in lins if c is not None} != {R, S}:
                    continue
                if any(has for _, _, has in lins):
                    for c, _, _ in lins:
                        found[c.side].add(c.name)
        out = []
        for side in (R, S):
            declared = self.declared_times.get(self.streams[side], "")
            if declared:
                out.append(declared)
            elif len(found[side]) == 1:
                out.append(next(iter(found[side])))
            else:
                raise ConfigError(
                    f"query: which column of {self.streams[side]} is its event time? "
                    + (
                        f"ON compares {', '.join(sorted(found[side]))} with an INTERVAL"
                        if found[side]
                        else "ON bounds none with an INTERVAL"
                    )
                    + f": declare streams.{self.streams[side]}.time"
                )
        return tuple(out)

    def _bound(self, part: Node, time: tuple[str, str]):
        """[(op, c)] meaning s.ts - r.ts op c (microseconds), if `part` bounds the two event times; else None."""
        if not isinstance(part, Call):
            return None
        if part.op == "and":
            bounds = [self._bound(a, time) for a in part.args]
            return None if None in bounds else [b for x in bounds for b in x]
        if part.op not in COMPARISONS or part.op == "ne":
            return None
        lins = [_linear(a) for a in part.args]
        if None in lins or any(c is None or c.name != time[c.side] for c, _, _ in lins):
            return None
        (a, oa, _), (b, ob, _) = lins
        if a.side == b.side:
            return None
        op = part.op if a.side == S else _FLIPPED[part.op]  # a + oa op b + ob
        return [(op, ob - oa if a.side == S else oa - ob)]

    def _terms(self, node: Node, terms: tuple[list, list]) -> Node:
        """The pair condition with each maximal single-stream piece replaced by a Term of that stream."""
        s = sides(node)
        if len(s) == 1:
            side = next(iter(s))
            if node not in terms[side]:
                terms[side].append(node)
            return Term(side, terms[side].index(node))
        if isinstance(node, Call):
            return Call(node.op, tuple(self._terms(a, terms) for a in node.args))
        return node

    def _grouping(self, join_type: str) -> Grouping:
        """GROUP BY's columns and Spark's `window(time, 'N seconds'[, 'M seconds'])`, and SELECT's aggregates:
        count(*), sum, min, max, avg and count(DISTINCT ...).  Outside inner joins the view groups by `kind` too,
        as `[aggregate]` does (protocol.aggregation)."""
        exp = self.exp
        groups, window = [], None
        for g in self.tree.args["group"].expressions:
            if isinstance(g, exp.Anonymous) and g.name.lower() == "window":
                window = self._window(g)
            elif isinstance(g, exp.Column):
                groups.append(self._column(g))
            else:
                raise ConfigError(f"query: GROUP BY {g.sql('spark')}: columns and window(time, 'N seconds') only")
        functions = {exp.Sum: "sum", exp.Min: "min", exp.Max: "max", exp.Avg: "avg"}
        measures = []
        for item in self.tree.expressions:
            node = item.this if isinstance(item, exp.Alias) else item
            if isinstance(node, exp.Column) and self._column(node) in groups:
                continue
            if isinstance(node, exp.Anonymous) and node.name.lower() == "window" and self._window(node) == window:
                continue
            if isinstance(node, exp.Count) and isinstance(node.this, exp.Star):
                measures.append(("count", None, None))
            elif (
                isinstance(node, exp.Count) and isinstance(node.this, exp.Distinct) and len(node.this.expressions) == 1
            ):
                col = self._measured(node.this.expressions[0], node)
                measures.append(("count_distinct", col.side, col.name))
            elif type(node) in functions:
                col = self._measured(node.this, node)
                measures.append((functions[type(node)], col.side, col.name))
            else:
                raise ConfigError(
                    f"query: SELECT {item.sql('spark')} with GROUP BY: a group column, the window, or count(*), "
                    "sum, min, max, avg, count(DISTINCT column)"
                )
        time, length, slide = window or (None, 0, 0)
        named = list(groups) + ([Col(*time)] if time else []) + [Col(s, c) for _, s, c in measures if c]
        if join_type in ("semi", "anti") and any(c.side == S for c in named):
            c = next(c for c in named if c.side == S)
            raise ConfigError(
                f"query: GROUP BY of a {join_type} join names {self.alias_names[S]}.{c.name}: its rows are "
                f"{self.streams[R]}'s alone"
            )
        return Grouping(tuple((c.side, c.name) for c in groups), time, length, slide, tuple(measures))

    def _window(self, node) -> tuple[tuple[int, str], int, int]:
        args = node.expressions
        if not 2 <= len(args) <= 3 or not isinstance(args[0], self.exp.Column):
            raise ConfigError(f"query: {node.sql('spark')}: window(time column, 'N seconds'[, 'M seconds'])")
        col = self._column(args[0])
        length, *slide = (_interval(self.exp.Interval(this=a)) for a in args[1:])
        return (col.side, col.name), length, slide[0] if slide else length

    def _measured(self, node, call) -> Col:
        if not isinstance(node, self.exp.Column):
            raise ConfigError(f"query: {call.sql('spark')}: an aggregate takes a column")
        return self._column(node)

    def _projection(self, join_type: str):
        exp, out = self.exp, []
        items = self.tree.expressions
        if len(items) == 1 and isinstance(items[0], exp.Star):
            return None
        for item in items:
            name = item.alias_or_name if isinstance(item, exp.Alias) else None
            node = item.this if isinstance(item, exp.Alias) else item
            if isinstance(node, exp.Column) and not node.table and node.name in ENGINE_COLUMNS:
                out.append((name or node.name, None, node.name))
                continue
            if isinstance(node, exp.Star) or isinstance(getattr(node, "this", None), exp.Star):
                raise ConfigError("query: SELECT * stands alone (each stream's columns as <stream>_<column>)")
            if not isinstance(node, exp.Column):
                raise ConfigError(
                    f"query: SELECT {item.sql('spark')}: only columns (with AS) are selected; compute the "
                    "rest where the results are read"
                )
            col = self._column(node)
            if join_type in ("semi", "anti") and col.side == S:
                raise ConfigError(
                    f"query: SELECT {item.sql('spark')}: a {join_type} join's rows are {self.streams[R]}'s alone"
                )
            out.append((name or col.name, col.side, col.name))
        seen = [o for o, _, _ in out]
        dup = next((o for o in seen if seen.count(o) > 1), None)
        if dup:
            raise ConfigError(f"query: two result columns named {dup}: give one another name with AS")
        return tuple(out)

    # -- expressions
    def _column(self, node) -> Col:
        if not node.table:
            raise ConfigError(
                f"query: column {node.name} needs its stream: write {self.alias_names[R]}.{node.name} or "
                f"{self.alias_names[S]}.{node.name}"
            )
        if node.table not in self.aliases:
            raise ConfigError(f"query: {node.table}.{node.name}: {node.table} is no table of the query")
        return Col(self.aliases[node.table], node.name)

    def _node(self, e) -> Node:
        exp = self.exp
        binary = {
            exp.And: "and",
            exp.Or: "or",
            exp.EQ: "eq",
            exp.NEQ: "ne",
            exp.LT: "lt",
            exp.LTE: "le",
            exp.GT: "gt",
            exp.GTE: "ge",
            exp.Add: "add",
            exp.Sub: "sub",
            exp.Mul: "mul",
            exp.Div: "div",
        }
        for cls, op in binary.items():
            if type(e) is cls:
                return Call(op, (self._node(e.this), self._node(e.expression)))
        if isinstance(e, exp.Paren):
            return self._node(e.this)
        if isinstance(e, exp.Column):
            return self._column(e)
        if isinstance(e, exp.Not):
            return Call("not", (self._node(e.this),))
        if isinstance(e, exp.Neg):
            return Call("neg", (self._node(e.this),))
        if isinstance(e, exp.Abs):
            return Call("abs", (self._node(e.this),))
        if isinstance(e, exp.Is) and isinstance(e.expression, exp.Null):
            return Call("is_null", (self._node(e.this),))
        if isinstance(e, exp.Between):
            x = self._node(e.this)
            low, high = self._node(e.args["low"]), self._node(e.args["high"])
            return Call("and", (Call("ge", (x, low)), Call("le", (x, high))))
        if isinstance(e, exp.In):
            if e.args.get("query"):
                raise ConfigError("query: IN (SELECT ...): subqueries are not supported in a streaming join")
            values = [self._node(v) for v in e.expressions]
            if not all(isinstance(v, Lit) and not v.interval for v in values):
                raise ConfigError(f"query: {e.sql('spark')}: IN takes a list of constants")
            return Call("in", (self._node(e.this), *values))
        if isinstance(e, exp.Interval):
            return Lit(_interval(e), interval=True)
        if isinstance(e, exp.Null):
            return Lit(None)
        if isinstance(e, exp.Boolean):
            return Lit(bool(e.this))
        if isinstance(e, exp.Literal):
            if e.is_string:
                return Lit(e.this)
            v = float(e.this)
            return Lit(int(e.this) if re.fullmatch(r"-?\d+", e.this) else v)
        if isinstance(e, (exp.Subquery, exp.Exists, exp.Select)):
            raise ConfigError("query: subqueries are not supported in a streaming join")
        if isinstance(e, exp.Func):
            raise ConfigError(
                f"query: function {e.sql('spark')} is not supported in a streaming join's conditions "
                "(ABS, arithmetic, comparisons, AND/OR/NOT, IS [NOT] NULL, IN and BETWEEN are)"
            )
        raise ConfigError(f"query: {e.sql('spark')} is not supported in a streaming join's conditions")


def _conjuncts(node: Node) -> list[Node]:
    if isinstance(node, Call) and node.op == "and":
        return [c for a in node.args for c in _conjuncts(a)]
    return [node]


def _constants(node: Node | None):
    if isinstance(node, Lit):
        yield node
    elif isinstance(node, Call):
        for a in node.args:
            yield from _constants(a)


def _comparisons(node: Node):
    if isinstance(node, Call):
        if node.op in COMPARISONS:
            yield node
        elif node.op == "and":
            for a in node.args:
                yield from _comparisons(a)


def _linear(node: Node) -> tuple[Col | None, int, bool] | None:
    """(column, offset in microseconds, whether an INTERVAL was seen) of `col [+-] INTERVAL ...`; None otherwise."""
    if isinstance(node, Col):
        return node, 0, False
    if isinstance(node, Lit) and node.interval:
        return None, node.value, True
    if isinstance(node, Call) and node.op in ("add", "sub"):
        a, b = (_linear(x) for x in node.args)
        if a is None or b is None or (a[0] is not None and b[0] is not None):
            return None
        if node.op == "sub" and b[0] is not None:
            return None
        sign = -1 if node.op == "sub" else 1
        if not (a[2] or b[2]):
            return None
        return a[0] or b[0], a[1] + sign * b[1], True
    return None


def _range(part: Node):
    """("band", r, s, d) for ABS(r.k - s.k) <= d (either order), ("less", r, s, 0) for r.k < s.k; else None."""
    if not isinstance(part, Call) or part.op not in ("le", "ge", "lt", "gt"):
        return None
    a, b = part.args
    op = part.op
    if isinstance(b, Call) and b.op == "abs":
        a, b, op = b, a, _FLIPPED[op]
    if isinstance(a, Call) and a.op == "abs" and op == "le" and isinstance(b, Lit) and isinstance(b.value, int):
        inner = a.args[0]
        if isinstance(inner, Call) and inner.op == "sub" and all(isinstance(x, Col) for x in inner.args):
            x, y = inner.args
            if {x.side, y.side} == {R, S}:
                r, s = (x, y) if x.side == R else (y, x)
                return "band", r.name, s.name, int(b.value)
    if op in ("lt", "gt") and all(isinstance(x, Col) for x in (a, b)) and {a.side, b.side} == {R, S}:
        lo, hi = (a, b) if op == "lt" else (b, a)
        if lo.side == R:  # r.k < s.k
            return "less", lo.name, hi.name, 0
    return None


def _interval(e) -> int:
    """An INTERVAL's microseconds: `INTERVAL 2 SECONDS`, `INTERVAL '2' SECOND`, `INTERVAL '1.5 seconds'`."""
    value = e.this.this if e.this is not None else ""
    unit = e.args.get("unit")
    unit = unit.name if unit is not None else ""
    if not unit:
        m = re.fullmatch(r"\s*(-?[\d.]+)\s*([a-zA-Z]+)\s*", str(value))
        if m is None:
            raise ConfigError(f"query: {e.sql('spark')}: an interval is a number and a unit, e.g. INTERVAL 2 SECONDS")
        value, unit = m.groups()
    unit = unit.lower().rstrip("s")
    if unit not in _UNITS_US:
        raise ConfigError(f"query: {e.sql('spark')}: units are {', '.join(u + 's' for u in _UNITS_US)}")
    from decimal import Decimal, InvalidOperation

    try:
        us = Decimal(str(value)) * _UNITS_US[unit]
    except InvalidOperation:
        raise ConfigError(f"query: {e.sql('spark')}: {value!r} is not a number") from None
    if us != us.to_integral_value():
        raise ConfigError(f"query: {e.sql('spark')}: event time is whole microseconds")
    return int(us)


#: the `join.*` keys a query sets (its JOIN type and ON)
QUERY_JOIN_KEYS = ("window", "lower", "upper", "type", "predicate", "band")


def apply_query(sql: str, streams: dict, cfg: dict, named: set) -> QueryPlan:
    """Compile `sql` over the `[streams.*]` tables as written (`streams`, before protocol.streams checks them) and
    set what it says there: each stream's side, key and time columns (the payload grows by the columns its
    filter and terms read), `cfg`'s join type, bounds and predicate, and a GROUP BY's `[aggregate]`.  `named`:
    the (section, key) pairs the config gave, which must not say again what the query says."""
    join = cfg["join"]
    if not streams or not isinstance(streams, dict):
        raise ConfigError("query: its tables are declared streams: one [streams.NAME] table per stream (docs/query.md)")
    plan = compile_query(
        sql, tuple(streams), tuple(t.get("time", "") if isinstance(t, dict) else "" for t in streams.values())
    )
    twice = [k for k in QUERY_JOIN_KEYS if ("join", k) in named]
    if twice:
        raise ConfigError(f"join.{twice[0]}: the query says it (its JOIN and ON): leave it out of the config")
    for side, name in enumerate(plan.streams):
        table = streams[name]
        if not isinstance(table, dict):
            continue  # protocol.streams names the mistake
        given = {"side": "RS"[side], "key": [k[side] for k in plan.keys], "time": plan.time[side]}
        for k, v in given.items():
            old = table.get(k)
            if old not in (None, "", []) and ([old] if k == "key" and isinstance(old, str) else old) != v:
                raise ConfigError(
                    f"streams.{name}.{k} = {old!r}, but the query makes it {v!r}: leave it out, or make them agree"
                )
            table[k] = v
        payload = table.get("payload", "*")
        if isinstance(payload, list):
            wanted = plan.read_columns(side) + [c for _, s, c in plan.projection or () if s == side]
            table["payload"] = payload + [c for c in dict.fromkeys(wanted) if c not in payload]
    if plan.projection is not None and plan.join_type == "inner" and any(c == "kind" for _, s, c in plan.projection):
        raise ConfigError("query: SELECT kind: an inner join's rows are all pairs; only other joins' rows have a kind")
    join.update(
        type=plan.join_type, lower=plan.lower / 1e6, upper=plan.upper / 1e6, predicate=plan.predicate, band=plan.band
    )
    if plan.aggregate is not None:
        _aggregate(plan, streams, cfg, named)
    return plan


#: the `aggregate.*` keys a query's GROUP BY sets
QUERY_AGGREGATE_KEYS = ("enabled", "group_by", "window", "slide", "time", "measures")


def _aggregate(plan: QueryPlan, streams: dict, cfg: dict, named: set) -> None:
    """A GROUP BY as `[aggregate]`: over the results' columns as SELECT * names them (<stream>_<column>)."""
    twice = [k for k in QUERY_AGGREGATE_KEYS if ("aggregate", k) in named]
    if twice:
        raise ConfigError(f"aggregate.{twice[0]}: the query's GROUP BY says it: leave it out of the config")
    tables = [streams[name] if isinstance(streams[name], dict) else {} for name in plan.streams]
    prefixes = [str(t.get("prefix", "{stream}_")).replace("{stream}", n) for t, n in zip(tables, plan.streams)]
    column = lambda side, name: prefixes[side] + name  # noqa: E731
    g = plan.aggregate
    cfg["aggregate"].update(
        enabled=True,
        group_by=[column(*c) for c in g.groups],
        window=g.window / 1e6,
        slide=g.slide / 1e6 if g.slide != g.window else 0.0,
        time=column(*g.time) if g.time else "",
        measures=[fn if c is None else f"{fn}({column(s, c)})" for fn, s, c in g.measures],
    )


def projected(table, plan: QueryPlan | None, prefixes: tuple[str, str]):
    """Result rows (each stream's columns as <prefix><column>, then the engine's) as the query's SELECT names
    them; as they are with SELECT * or without a query."""
    if plan is None or plan.projection is None:
        return table
    names = [c if s is None else prefixes[s] + c for _, s, c in plan.projection]
    return table.select(names).rename_columns([out for out, _, _ in plan.projection])


def config_plan(cfg: dict) -> QueryPlan:
    """The plan of a run: its query's, or the one its `join.*` keys and streams mean (no filter, condition or
    projection): the plan's `shape` (protocol.plan), what `streamjoin explain` prints first."""
    plan = plan_of(cfg)
    if plan is not None:
        return plan
    from protocol.predicates import time_bounds
    from protocol.streams import single_streams

    join = cfg["join"]
    (r, rs), (s, ss) = (cfg.get("streams") or single_streams(cfg["source"], join)).items()
    lower, upper = time_bounds(join)
    return QueryPlan(
        sql="",
        streams=(r, s),
        aliases=(r, s),
        join_type=join["type"],
        keys=tuple(zip(rs["key"], ss["key"])),
        time=(rs["time"], ss["time"]),
        lower=lower,
        upper=upper,
        open=(False, False),
        predicate=join["predicate"],
        band=join["band"],
        filters=(None, None),
        terms=((), ()),
        condition=None,
        projection=None,
    )


def plan_of(cfg: dict) -> QueryPlan | None:
    """The run's query plan (`query.sql`), None without one; parsed once per process and query."""
    sql = cfg.get("query", {}).get("sql", "")
    if not sql:
        return None
    streams = cfg.get("streams") or {}
    return compile_query(sql, tuple(streams), tuple(s.get("time", "") for s in streams.values()))
