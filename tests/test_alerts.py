"""The alert rules (config/prometheus/alerts.yml): promtool finds them valid and their unit tests
(tests/prometheus/alerts_test.yml, and saturation_test.yml at 15 s) pass; every alert says how
urgent it is, what it means and which section of docs/operations.rst to read; every metric a rule
reads is one /metrics exports, and every label it matches or groups by is one of its metrics' (or
job, instance)."""

import itertools
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promql import parse

from animal_store import create_app
from animal_store.extensions import db
from animal_store.observability import master_metrics, metrics

PROJECT_DIR = Path(__file__).resolve().parent.parent
RULES = PROJECT_DIR / "config" / "prometheus" / "alerts.yml"
RULE_TESTS = [
    PROJECT_DIR / "tests" / "prometheus" / name
    for name in ("alerts_test.yml", "saturation_test.yml")
]
OPERATIONS = PROJECT_DIR / "docs" / "operations.rst"

ALERTS = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
# Prometheus' own, for each target it scrapes: {name: its labels} (job and instance only).
SCRAPE_METRICS = {"up": frozenset()}
# What each type of family exports besides its name (prometheus_client's text format).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "info": ("_info",),
}


@pytest.fixture(scope="module")
def promtool():
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: prometheus)")
    return found


def run_promtool(promtool, *args):
    done = subprocess.run(
        [promtool, *args], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}: exit {done.returncode}\n" + (
        done.stdout + done.stderr
    )


def test_promtool_finds_the_rules_valid(promtool):
    run_promtool(promtool, "check", "rules", str(RULES))


def test_the_rules_pass_their_unit_tests(promtool):
    # rule_files in the test file are relative to its own directory.
    run_promtool(promtool, "test", "rules", *map(str, RULE_TESTS))


def section_titles(rst: str) -> set[str]:
    """The titles of a reStructuredText document's sections: a line followed by one of the
    same length made of one punctuation character repeated (=, -, ~, ...)."""
    lines = rst.splitlines()
    return {
        title.strip()
        for title, underline in itertools.pairwise(lines)
        if title.strip()
        and len(underline) == len(title)
        and re.fullmatch(r"([=\-~.^\"'`#*+:_])\1*", underline)
    }


OPERATIONS_SECTIONS = section_titles(OPERATIONS.read_text())


def sections_named(description: str) -> list[str]:
    """What follows each "docs/operations.rst, " of a description: a section's title, then the
    rest of the description."""
    return [
        description[match.end() :]
        for match in re.finditer(r"docs/operations\.rst,\s+", description)
    ]


def starts_with_a_title(text: str, titles: set[str]) -> bool:
    """Whether `text` starts with one of `titles`, whole: followed by its end or punctuation
    ("Database outages." and "Upgrading, and ..." do, "Database outage." does not)."""
    return any(
        text.startswith(title) and re.match(r"$|[.,;:)]", text[len(title) :]) for title in titles
    )


def test_operations_has_the_sections_alerts_name():
    # The parser itself: it finds titles of each level and no body text.
    assert {"Database outages", "Failed key checks, per client address", "Metrics"} <= (
        OPERATIONS_SECTIONS
    )
    assert "When PostgreSQL hangs" in OPERATIONS_SECTIONS
    assert not any(len(title) > 60 for title in OPERATIONS_SECTIONS)
    assert starts_with_a_title("Database outages.", OPERATIONS_SECTIONS)
    assert starts_with_a_title("Upgrading, and more", OPERATIONS_SECTIONS)
    assert not starts_with_a_title("Database outage.", OPERATIONS_SECTIONS)


@pytest.mark.parametrize("alert", ALERTS, ids=[alert["alert"] for alert in ALERTS])
def test_an_alert_says_how_urgent_and_where_to_read(alert):
    name = alert["alert"]
    assert re.fullmatch(r"AnimalStore[A-Z][A-Za-z]+", name)
    assert alert["labels"]["severity"] in {"page", "ticket"}
    annotations = alert["annotations"]
    assert annotations["summary"].strip()
    description = annotations["description"]
    named = sections_named(description)
    assert named, f"{name}'s description names no section of docs/operations.rst"
    for rest in named:
        assert starts_with_a_title(rest, OPERATIONS_SECTIONS), (
            f"{name}: docs/operations.rst has no section at {rest[:50]!r}"
        )
    assert "for" in alert, f"{name} has no `for`"


@pytest.fixture(scope="module")
def exported_metrics(tmp_path_factory) -> dict[str, frozenset[str]]:
    """{name: its labels} for every metric name /metrics exports: the families' names, their
    samples' names, and those of families with no sample yet, from their type. Scraped twice: in
    process, and as under gunicorn (PROMETHEUS_MULTIPROC_DIR), which adds the instance's
    process_* figures and animal_store_processes. Requests first count one of each labelled
    series (two 401s, then a 429 past AUTH_FAILURE_LIMIT), so each labelled metric shows its
    labels. With them, what only the metrics listener adds
    (animal_store/observability/master_metrics.py): the listen queue's figures, read from a
    listening socket of the test's own."""
    directory = tmp_path_factory.mktemp("alerts")
    app = create_app(
        {
            "TESTING": True,
            "DATABASE_URL": f"sqlite:///{directory}/x.db",
            "AUTH_FAILURE_LIMIT": "2 per hour",
        }
    )
    client = app.test_client()
    statuses = [client.get("/v1/pets").status_code for _ in range(3)]
    assert statuses == [401, 401, 429]
    texts = [client.get("/metrics").get_data(as_text=True)]
    with pytest.MonkeyPatch.context() as patch:
        multiproc_dir = directory / "multiproc"
        multiproc_dir.mkdir()
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc_dir))
        patch.setattr(metrics, "MULTIPROCESS", True)
        texts.append(client.get("/metrics").get_data(as_text=True))
    with app.app_context():
        db.engine.dispose()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        registry = CollectorRegistry()
        registry.register(master_metrics.ListenQueues([listener]))
        registry.register(master_metrics.InstanceProcesses(os.getpid()))
        texts.append(generate_latest(registry).decode())
    labels: dict[str, set[str]] = {name: set(names) for name, names in SCRAPE_METRICS.items()}
    for text in texts:
        for family in text_string_to_metric_families(text):
            suffixes = SAMPLE_SUFFIXES.get(family.type, ())
            for name in [family.name] + [family.name + suffix for suffix in suffixes]:
                labels.setdefault(name, set())
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    assert "animal_store_processes" in labels
    assert labels["animal_store_refusals_total"] == {"reason"}
    assert labels["animal_store_listen_queue_connections"] == {"listener"}
    assert labels["animal_store_database_reads_unproven_total"] == {"reason"}
    return {name: frozenset(names) for name, names in labels.items()}


@pytest.mark.parametrize("alert", ALERTS, ids=[alert["alert"] for alert in ALERTS])
def test_an_alert_reads_only_metrics_the_service_exports(alert, exported_metrics):
    query = parse(alert["expr"])
    assert query.metrics, f"{alert['alert']} reads no metric"
    problems = query.unexported(exported_metrics)
    assert not problems, f"{alert['alert']} reads what /metrics does not export: {problems}"
