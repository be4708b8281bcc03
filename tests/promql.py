"""PromQL, as much of it as the tests that hold alert rules and dashboards to what /metrics
exports need (tests/test_alerts.py, tests/test_dashboard.py): the metrics an expression reads,
each selector's label matchers, and the labels it groups or matches by. Standard library only,
no parser of Prometheus' own; its own tests are tests/test_promql.py.

    >>> sorted(metric_names('sum by (job) (rate(a_total{status=~"5.."}[5m])) / on (job) b > 0'))
    ['a_total', 'b']
    >>> query = parse('sum by (job) (rate(a_total{status=~"5.."}[5m])) / on (job) b > 0')
    >>> query.selectors[0], sorted(query.grouping)
    (Selector(metric='a_total', matchers={'status': ('=~', '5..')}), ['job'])

A tokenizer and a reader of selectors, not a full parser: a name is a metric unless it calls (a
function: followed by "("), aggregates (sum, count, topk... also in `sum by (job) (...)`) or is a
keyword (and, or, unless, bool, offset, atan2, inf, nan; any case). Skipped: strings, comments,
numbers and durations, what is inside [...] (ranges, subqueries). What PromQL does not have
(Grafana's $variables among it: tests/test_dashboard.py turns a Grafana query into PromQL first)
is a ValueError, not something silently passed over.
"""

import ast
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["STRING", "TARGET_LABELS", "Query", "Selector", "metric_names", "parse"]

# A string literal: "..." and '...' with backslash escapes, `...` raw.
STRING = re.compile(r"""\"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`""")
TOKEN = re.compile(
    rf"""
    (?P<string>{STRING.pattern})
  | (?P<comment>\#[^\n]*)
  | (?P<range>\[[^\]]*\])                                # [5m], [1h:1m], [30m:]
  | (?P<number>(?:\d+(?:ms|[smhdwy]))+
      |0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<operator>=~|!~|!=|==|>=|<=|[-+*/%^=<>@(){{}},])
  | (?P<space>\s+)
  | (?P<error>.)
    """,
    re.VERBOSE,
)
MATCH_OPERATORS = frozenset({"=", "!=", "=~", "!~"})
# Never a metric, compared lowercase (PromQL's keywords are case-insensitive).
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
# Keywords whose parentheses hold label names, not expressions.
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
# Labels Prometheus adds to every series it scrapes: not in /metrics, on every series.
TARGET_LABELS = frozenset({"job", "instance"})


class Selector(NamedTuple):
    """A vector selector: its metric (None for {__name__=~"..."}) and its matchers, {label:
    (operator, value)} (the last, when a label is matched twice)."""

    metric: str | None
    matchers: dict[str, tuple[str, str]]


@dataclass
class Query:
    """What one PromQL expression reads: its selectors, and the labels it groups or matches by
    (by, without, on, ignoring, group_left, group_right)."""

    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        return {selector.metric for selector in self.selectors if selector.metric}

    def unexported(self, exported: Mapping[str, Collection[str]]) -> list[str]:
        """What this reads that `exported` ({sample name: its labels}, as a scrape gives them)
        has not: metrics, labels a selector matches that its metric lacks, and labels it groups
        by that none of its metrics has. Every series has TARGET_LABELS."""
        problems = [f"metric {metric}" for metric in sorted(self.metrics - exported.keys())]
        for metric, matchers in self.selectors:
            if metric in exported:
                unknown = matchers.keys() - set(exported[metric]) - TARGET_LABELS
                problems.extend(f"label {label} of {metric}" for label in sorted(unknown))
        if self.metrics <= exported.keys():  # an unknown metric's labels are unknown too
            known = TARGET_LABELS.union(*(exported[metric] for metric in self.metrics))
            unknown = self.grouping - known
            problems.extend(f"label {label} (grouped by)" for label in sorted(unknown))
        return problems


def metric_names(expr: str) -> set[str]:
    """Return the names of the metrics `expr` reads."""
    return parse(expr).metrics


def parse(expr: str) -> Query:
    """The selectors and grouping labels of a PromQL expression; a ValueError if it has what
    PromQL does not."""
    tokens = []
    for token in TOKEN.finditer(expr):
        kind = token.lastgroup
        if kind == "error":
            raise ValueError(f"cannot read {token[0]!r} at {token.start()} of {expr!r}")
        if kind not in ("space", "comment"):
            tokens.append((kind, token[0]))
    query = Query()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        word = text.lower() if kind == "name" else None
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if word in LABEL_LISTS:
            i += 1
            if following == "(":  # by (a, b): the labels up to the closing parenthesis
                i += 1
                while i < len(tokens) and tokens[i][1] != ")":
                    if tokens[i][0] in ("name", "string"):
                        query.grouping.add(label_name(tokens[i]))
                    i += 1
                i += 1
            continue
        if kind == "name" and (following == "(" or word in KEYWORDS or word in AGGREGATIONS):
            i += 1  # a function, an aggregation (sum by (x) (...)), a keyword
            continue
        if kind == "name" or text == "{":
            metric = text if kind == "name" else None
            i += 1 if kind == "name" else 0
            matchers: dict[str, tuple[str, str]] = {}
            if i < len(tokens) and tokens[i][1] == "{":
                i, matchers, quoted = read_matchers(tokens, i + 1, expr)
                metric = metric or quoted
            if "__name__" in matchers and matchers["__name__"][0] == "=":
                metric = metric or matchers.pop("__name__")[1]
            query.selectors.append(Selector(metric, matchers))
            continue
        i += 1
    return query


def read_matchers(tokens, i, expr):
    """The matchers from tokens[i] to the closing brace: the index after it, {label: (operator,
    value)}, and the metric a lone string names ({"metric.name"}, Prometheus 3's quoting)."""
    matchers, quoted = {}, None
    while i < len(tokens) and tokens[i][1] != "}":
        kind, text = tokens[i]
        if (
            kind in ("name", "string")
            and i + 2 < len(tokens)
            and tokens[i + 1][1] in MATCH_OPERATORS
            and tokens[i + 2][0] == "string"
        ):
            matchers[label_name(tokens[i])] = (tokens[i + 1][1], unquote(tokens[i + 2][1]))
            i += 3
        elif kind == "string":
            quoted = unquote(text)
            i += 1
        else:
            raise ValueError(f"cannot read the matchers of {expr!r} at {text!r}")
        if i < len(tokens) and tokens[i][1] == ",":
            i += 1
        elif i < len(tokens) and tokens[i][1] != "}":
            raise ValueError(f"cannot read the matchers of {expr!r} at {tokens[i][1]!r}")
    if i == len(tokens):
        raise ValueError(f"no closing brace in {expr!r}")
    return i + 1, matchers, quoted


def label_name(token: tuple[str, str]) -> str:
    """A label's name: as it is, or quoted ("label.name", Prometheus 3)."""
    kind, text = token
    return unquote(text) if kind == "string" else text


def unquote(literal: str) -> str:
    """A string literal's value: a raw `...` as it is, "..." and '...' with their escapes
    (Go's, which for these are Python's)."""
    return literal[1:-1] if literal.startswith("`") else ast.literal_eval(literal)
