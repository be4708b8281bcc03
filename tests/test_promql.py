"""tests/promql.py, the PromQL reader tests/test_alerts.py and tests/test_dashboard.py hold the
alert rules and the dashboard to /metrics with: it finds each metric, matcher and grouping label,
and refuses what it cannot read rather than pass over it."""

import pytest
from promql import Query, Selector, metric_names, parse


@pytest.mark.parametrize(
    ("expression", "metrics", "grouping"),
    [
        ("up", {"up"}, set()),
        ('sum by (a, b) (rate(x_total{job="j", i=~"$instance"}[5m]))', {"x_total"}, {"a", "b"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))", {"h_bucket"}, {"le"}),
        ("sum(rate(x[5m])) by (job)", {"x"}, {"job"}),
        ("SUM BY (job) (x) AND ON (job) y", {"x", "y"}, {"job"}),
        ("sum without (pid) (g) / on (instance) group_left (v) (p - 1)", {"g", "p"},
         {"pid", "instance", "v"}),
        ("a * ignoring (x) group_right b", {"a", "b"}, {"x"}),
        ('a and bool b offset 1h30m or c{d="e}"} unless d @ start()', {"a", "b", "c", "d"}, set()),
        ('{__name__="n", l!="x"} * 1e3 + {"quoted.name"} + Inf - NaN', {"n", "quoted.name"},
         set()),
        ("{__name__='single'} + {__name__=`raw`} + {__name__=~\"any.*\"}", {"single", "raw"},
         set()),
        ("max_over_time(rate(m[5m])[1h:1m]) > 0x1f", {"m"}, set()),
        ("count(count by (version) (build_info))", {"build_info"}, {"version"}),
        ("topk(5, q) + count_values(\"v\", w) + quantile(0.9, z) atan2 .5", {"q", "w", "z"},
         set()),
        ('label_replace(x, "dst", "$1", "src", "(.*)")', {"x"}, set()),
        ("job:requests:rate5m offset -5m", {"job:requests:rate5m"}, set()),
        ("a # a comment: b\n + c", {"a", "c"}, set()),
        ('sum by ("quoted.label") (x)', {"x"}, {"quoted.label"}),
        ("vector(1) + time()", set(), set()),
    ],
)  # fmt: skip
def test_parse_finds_the_metrics_and_grouping_labels(expression, metrics, grouping):
    query = parse(expression)
    assert query.metrics == metrics
    assert query.grouping == grouping
    assert metric_names(expression) == metrics


def test_parse_reads_matchers():
    (selector,) = parse(r'x{job="animal-store", instance=~"$instance", s!~"5\\.."}').selectors
    assert selector == Selector(
        "x",
        {"job": ("=", "animal-store"), "instance": ("=~", "$instance"), "s": ("!~", r"5\..")},
    )
    assert parse('{"quoted.name", "label.x"="v", y!=\'w\',}').selectors == [
        ("quoted.name", {"label.x": ("=", "v"), "y": ("!=", "w")})
    ]
    assert parse('{__name__=~"a|b", z="1"}').selectors == [
        (None, {"__name__": ("=~", "a|b"), "z": ("=", "1")})
    ]


@pytest.mark.parametrize(
    "expression",
    [
        "rate(x[5m]) ~ 1",
        "x > $threshold",  # Grafana's, not PromQL's
        'x{job="a" instance="b"}',
        'x{job="a"',
        "x{job=a}",
    ],
)
def test_parse_refuses_what_it_cannot_read(expression):
    with pytest.raises(ValueError, match=r"cannot read|no closing brace"):
        parse(expression)


def test_unexported_names_the_metrics_and_labels_a_scrape_lacks():
    exported = {"a_total": {"status"}, "b": set(), "h_bucket": {"le", "operation"}}
    assert (
        parse('sum by (job, status) (a_total{instance="i", status="500"})').unexported(exported)
        == []
    )
    assert (
        parse('sum by (le) (h_bucket{operation="x"}) / on (instance) b').unexported(exported) == []
    )
    assert parse('a_totl{status="500"} + b{statuss="1"}').unexported(exported) == [
        "metric a_totl",
        "label statuss of b",
    ]
    assert parse("sum by (operation) (a_total)").unexported(exported) == [
        "label operation (grouped by)"
    ]
    # Grouped by a label of another metric of the query: known.
    assert (
        parse("sum by (operation) (a_total) + on (operation) h_bucket").unexported(exported) == []
    )
    assert Query().unexported(exported) == []
