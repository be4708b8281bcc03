"""`flask keys create/list/revoke`: the only way keys are made and retired."""

import re
import socket
from datetime import UTC, datetime, timedelta

import pytest


def test_keys_create_prints_a_working_key_as_last_line(client, runner):
    result = runner.invoke(args=["keys", "create", "shop-frontend"])
    assert result.exit_code == 0
    key = result.output.strip().splitlines()[-1]
    assert key.startswith("ask_")
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_keys_create_refuses_a_taken_name(runner):
    assert runner.invoke(args=["keys", "create", "shop"]).exit_code == 0
    result = runner.invoke(args=["keys", "create", "shop"])
    assert result.exit_code != 0
    assert "exists already" in result.output


@pytest.mark.parametrize("name", ["", "x" * 101])
def test_keys_create_refuses_bad_names(runner, name):
    result = runner.invoke(args=["keys", "create", name])
    assert result.exit_code != 0


def test_keys_list_shows_metadata_never_the_key(client, runner):
    key = runner.invoke(args=["keys", "create", "alpha"]).output.strip().splitlines()[-1]
    beta = ["keys", "create", "beta", "--rate-limit", "100/second", "--scopes", "read"]
    runner.invoke(args=[*beta, "--expires", "2099-06-30T00:00:00Z"])
    client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"})
    runner.invoke(args=["keys", "revoke", "beta"])
    result = runner.invoke(args=["keys", "list"])
    assert result.exit_code == 0
    assert key not in result.output
    assert key[4:20] not in result.output
    header, alpha, beta = result.output.strip().splitlines()
    assert header.split() == [
        "NAME",
        "PREFIX",
        "SCOPES",
        "EXPIRES",
        "RATE",
        "LIMIT",
        "CREATED",
        "LAST",
        "USED",
        "STATE",
    ]
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert alpha.split()[:4] == ["alpha", key[:10] + "...", "read,write", "never"]
    assert "6000 per minute (default)" in alpha
    assert alpha.count(today) == 2  # created and last used
    assert alpha.endswith("active")
    assert beta.split()[2:4] == ["read", "2099-06-30"]
    assert "100/second" in beta
    assert "never" in beta  # never used
    assert f"revoked {today}" in beta


def test_keys_revoke_unknown_or_twice_fails(runner):
    assert runner.invoke(args=["keys", "revoke", "ghost"]).exit_code != 0
    runner.invoke(args=["keys", "create", "once"])
    assert runner.invoke(args=["keys", "revoke", "once"]).exit_code == 0
    result = runner.invoke(args=["keys", "revoke", "once"])
    assert result.exit_code != 0
    assert "revoked already" in result.output


def test_format_time_is_utc():
    from animal_store.cli import format_time

    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(0)
    assert format_time(moment) == "2026-01-02 03:04:05 UTC"
    assert format_time(None) == "never"


def test_quickstart_again_while_its_server_runs_makes_a_key_and_exits(client, runner):
    # The first quickstart's server holds the port; the second run only makes another key.
    with socket.create_server(("127.0.0.1", 0)) as first_server:
        port = first_server.getsockname()[1]
        result = runner.invoke(args=["quickstart", "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert "no second server is started" in result.output
    (key,) = re.findall(r"\(shown only now\): (ask_\S+)", result.output)
    assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200
