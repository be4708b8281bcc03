"""The Grafana dashboard, config/grafana/animal-store.json: every query names only metrics (and
labels) the service exports, as a live gunicorn serves them to Prometheus, and the file has what
Grafana's importer relies on.

The exported names come from what Prometheus scrapes, a real gunicorn's metrics listener
(ANIMAL_STORE_METRICS_BIND), not the test client's /metrics: in one process, without
PROMETHEUS_MULTIPROC_DIR, the app serves prometheus_client's default registry, which has no
animal_store_processes and other process_* figures than the instance's (metrics.serve_metrics,
InstanceProcesses), and *_created samples Prometheus never gets from gunicorn; and only the
listener has the listen queue's figures. Under gunicorn a labelled metric has no series until one
is counted, so the instance is first sent requests that count one of each (a 401 and, past
AUTH_FAILURE_LIMIT, a 429). Prometheus adds `up` for each target it scrapes (PROMETHEUS_OWN).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import promql
import pytest
import requests
from nginx_server import free_port
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD_PATH = Path(__file__).resolve().parent.parent / "config" / "grafana" / "animal-store.json"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
JOB = "animal-store"
# Prometheus' own series for each target, {name: its labels} (job and instance only): there
# whether the target answered its scrape or not.
PROMETHEUS_OWN = {"up": frozenset()}
# The figures the metrics listener reads itself, not from the workers' files: the panels that
# show an instance full of clients.
LISTENER_OWN = (
    "animal_store_listen_queue_connections",
    "animal_store_listen_queue_connections_max",
    "animal_store_listen_queue_backlog",
    "animal_store_listen_queue_overflows_total",
)
# What an instance full of clients shows: the listener's figures, and the requests it shed.
OVERLOAD = (*LISTENER_OWN, "animal_store_requests_shed_total")


def walk(panels):
    """Every panel, those inside rows (a collapsed row holds its own) included."""
    for panel in panels:
        yield panel
        yield from walk(panel.get("panels", []))


PANELS = list(walk(DASHBOARD["panels"]))
QUERY_PANELS = [p for p in PANELS if p["type"] != "row"]
VARIABLES = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]


# Grafana's part of a query, turned into PromQL for tests/promql.py to read: its variables ($x,
# ${x}, ${x:format}, [[x]], $__rate_interval...) and its template queries, label_values([selector,
# ]label) and query_result(expression) (label_names() and metrics(regex) name no metric of ours).

VARIABLE = r"\$\w+|\$\{[^}]*\}|\[\[[\w:.]+\]\]"
# A PromQL string (group 1), or a variable outside one.
STRING_OR_VARIABLE = re.compile(f"({promql.STRING.pattern})|{VARIABLE}")
LABEL_VALUES = re.compile(r"label_values\((?:(.+),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)\s*", re.S)
QUERY_RESULT = re.compile(r"query_result\((.+)\)\s*", re.S)


def as_promql(expression: str) -> str:
    """`expression` as PromQL: each variable outside a string replaced by a value that fits its
    place, a duration in a range or a subquery's step ([$__rate_interval], [$__range:$step]), a
    number elsewhere. A string stays as it is: a matcher's value is "$instance", as written."""

    def value(match: re.Match[str]) -> str:
        if match[1] is not None:
            return match[1]
        return "5m" if expression[match.start() - 1 : match.start()] in ("[", ":") else "1"

    return STRING_OR_VARIABLE.sub(value, expression)


def read(expression: str) -> promql.Query:
    """The metrics, matchers and grouping labels of a panel's query or a template query: those
    of label_values' selector, with the label it lists as one grouped by (the selector's metric
    has it)."""
    expression = expression.strip()
    if match := LABEL_VALUES.fullmatch(expression):
        query = promql.parse(as_promql(match[1] or ""))
        query.grouping.add(match[2])
        return query
    if match := QUERY_RESULT.fullmatch(expression):
        expression = match[1]
    return promql.parse(as_promql(expression))


@pytest.mark.parametrize(
    ("expression", "promql_text"),
    [
        ('sum by (a) (rate(x_total{i=~"$instance"}[$__rate_interval]))',
         'sum by (a) (rate(x_total{i=~"$instance"}[5m]))'),
        ("max_over_time(m[${__range}:${__interval}]) > $threshold",
         "max_over_time(m[5m:5m]) > 1"),
        ("rate(y[[[window]]]) * [[scale:raw]] + count_values(`$v`, z)",
         "rate(y[5m]) * 1 + count_values(`$v`, z)"),
    ],
)  # fmt: skip
def test_as_promql_gives_each_variable_a_value_outside_strings(expression, promql_text):
    assert as_promql(expression) == promql_text


@pytest.mark.parametrize(
    ("expression", "metrics", "grouping"),
    [
        ('sum by (a) (rate(x_total{i=~"$instance"}[$__rate_interval])) > $t', {"x_total"}, {"a"}),
        ('label_values(p{job="j"}, instance)', {"p"}, {"instance"}),
        ("label_values(instance)", set(), {"instance"}),
        ("query_result(topk(5, q[$__range]))", {"q"}, set()),
    ],
)  # fmt: skip
def test_read_finds_the_metrics_and_labels_of_a_grafana_query(expression, metrics, grouping):
    query = read(expression)
    assert query.metrics == metrics
    assert query.grouping == grouping


def test_every_panel_query_is_promql_promtool_reads(tmp_path):
    """What as_promql makes of each panel's query is PromQL: as a recording rule's, promtool
    parses it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: prometheus)")
    expressions = [as_promql(t["expr"]) for p in QUERY_PANELS for t in p["targets"]]
    rules = [{"record": f"dashboard:query{n}", "expr": e} for n, e in enumerate(expressions)]
    path = tmp_path / "queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# What a live instance exports, read once per run.

_exported: dict[str, frozenset[str]] = {}


@pytest.fixture
def exported(request) -> dict[str, frozenset[str]]:
    """{sample name: its labels} of one scrape of a live gunicorn's metrics listener (one worker,
    on a fresh database), as Prometheus reads it, with Prometheus' own. The first test that needs
    it starts the instance; the others reuse what it read, since the names do not change within a
    run."""
    if not _exported:
        _exported.update(scrape_an_instance(request.getfixturevalue("start_gunicorn")))
    return _exported


def scrape_an_instance(start_gunicorn) -> dict[str, frozenset[str]]:
    metrics_address = f"127.0.0.1:{free_port()}"
    server = start_gunicorn(
        workers=1,
        env={
            "ANIMAL_STORE_AUTH_FAILURE_LIMIT": "2 per hour",
            "ANIMAL_STORE_METRICS_BIND": metrics_address,
            # Each answer counted in the files at once, for the listener's scrape just after.
            "ANIMAL_STORE_METRICS_WRITE_INTERVAL": "0",
        },
    )
    # Without a key: two 401s (auth_failures_total{reason="missing"}), then a 429 (the address
    # past its budget: refusals_total{reason="auth_failures"}, rate_limited_total).
    statuses = [requests.get(server.url + "/v1/pets", timeout=10).status_code for _ in range(3)]
    assert statuses == [401, 401, 429]
    response = requests.get(f"http://{metrics_address}/metrics", timeout=10)
    assert response.status_code == 200
    labels: dict[str, set[str]] = {name: set(names) for name, names in PROMETHEUS_OWN.items()}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


def queries(panel) -> list[tuple[str, str]]:
    return [(target["refId"], target["expr"]) for target in panel["targets"]]


@pytest.mark.parametrize("panel", QUERY_PANELS, ids=[p["title"] for p in QUERY_PANELS])
def test_every_query_of_a_panel_names_only_exported_metrics(panel, exported):
    assert panel["targets"]
    for ref_id, expression in queries(panel):
        query = read(expression)
        assert query.metrics, f"query {ref_id} ({expression}) reads no metric"
        problems = query.unexported(exported)
        assert not problems, (
            f"query {ref_id} ({expression}) reads {problems}, which no instance exports; "
            f"it exports {sorted(exported)}"
        )


@pytest.mark.parametrize("variable", VARIABLES, ids=[v["name"] for v in VARIABLES])
def test_every_template_query_names_only_exported_metrics(variable, exported):
    query = variable["query"]  # a string, or the query editor's object (Grafana 10 and later)
    query = query["query"] if isinstance(query, dict) else query
    for expression in filter(None, (query, variable.get("definition"))):
        query = read(expression)
        assert query.metrics, f"{expression!r} reads no metric"
        problems = query.unexported(exported)
        assert not problems, f"{expression} reads {problems}; exported: {sorted(exported)}"


def test_the_scrape_is_an_instances_not_a_single_process(exported):
    """The scrape the other tests trust has what an operator's Prometheus reads from gunicorn,
    the per-instance figures included, and not the single process' own."""
    for name in (
        "animal_store_processes",
        "process_resident_memory_bytes",
        "animal_store_refusals_total",
        "animal_store_auth_failures_total",
        "animal_store_request_duration_seconds_bucket",
        *LISTENER_OWN,
    ):
        assert name in exported
    assert "animal_store_requests_created" not in exported
    assert not [name for name in exported if name.startswith("python_gc_")]


# What Grafana's importer relies on.


def test_the_dashboard_asks_for_a_prometheus_data_source_on_import():
    assert DASHBOARD["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": DASHBOARD["__inputs"][0]["description"],
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    required = {(r["type"], r["id"]) for r in DASHBOARD["__requires"]}
    assert ("datasource", "prometheus") in required
    assert {("panel", p["type"]) for p in QUERY_PANELS} <= required
    assert DASHBOARD["id"] is None  # the importer gives it one
    assert DASHBOARD["uid"]
    assert DASHBOARD["title"]
    assert DASHBOARD["schemaVersion"] >= 36  # panels' datasources as objects


def test_panel_ids_are_unique_and_the_panels_fit_the_grid():
    ids = [panel["id"] for panel in PANELS]
    assert len(ids) == len(set(ids)), ids
    # The top level, and each collapsed row's panels (laid out when it opens), never overlap.
    for level in [DASHBOARD["panels"]] + [p["panels"] for p in PANELS if p.get("collapsed")]:
        cells = {}
        for panel in level:
            place = panel["gridPos"]
            assert place["x"] >= 0
            assert place["w"] > 0
            assert place["h"] > 0
            assert place["x"] + place["w"] <= 24, panel["title"]
            for x in range(place["x"], place["x"] + place["w"]):
                for y in range(place["y"], place["y"] + place["h"]):
                    assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                    cells[x, y] = panel["title"]


@pytest.mark.parametrize("panel", PANELS, ids=[p["title"] for p in PANELS])
def test_every_panel_has_a_title_and_queries_the_input_data_source(panel):
    assert panel["title"].strip()
    if panel["type"] == "row":
        assert panel.get("collapsed") or not panel["panels"]  # an open row holds none
        return
    assert panel["description"].strip()
    assert "\n" not in panel["description"]
    assert panel["datasource"] == DATASOURCE
    if panel["type"] in ("timeseries", "stat"):
        assert panel["fieldConfig"]["defaults"]["unit"]
    ref_ids = [target["refId"] for target in panel["targets"]]
    assert len(ref_ids) == len(set(ref_ids)), ref_ids
    for target in panel["targets"]:
        assert target["refId"]
        assert target["datasource"] == DATASOURCE
        assert target["expr"].strip()
        # Each selector is the service's job, on the instances the variable chose.
        for _, matchers in read(target["expr"]).selectors:
            assert matchers.get("job") == ("=", JOB), target["expr"]
            assert matchers.get("instance") == ("=~", "$instance"), target["expr"]


def test_the_instance_variable_offers_every_instance():
    (instance,) = [v for v in VARIABLES if v["name"] == "instance"]
    assert instance["datasource"] == DATASOURCE
    assert instance["multi"]
    assert instance["includeAll"]
    for _, matchers in read(instance["query"]).selectors:
        assert matchers.get("job") == ("=", JOB)
    # Listed from a series Prometheus records for every target, answered or not: an instance
    # whose workers are all busy, or whose scrapes fail, stays in the list (a metric the workers
    # write could go stale, one of the listener's is gone when the listener is).
    assert read(instance["query"]).metrics == set(PROMETHEUS_OWN)
    used = [t["expr"] for p in QUERY_PANELS for t in p["targets"]]
    assert all("$instance" in expression for expression in used)


def test_the_listen_queue_and_what_it_sheds_and_drops_have_panels():
    read_by_panels = set().union(
        *(read(target["expr"]).metrics for panel in QUERY_PANELS for target in panel["targets"])
    )
    missing = [name for name in OVERLOAD if name not in read_by_panels]
    assert not missing, f"no panel reads {missing}"
