"""Alerts: Slack-compatible JSON to a webhook whose URL never sits in params.yaml; a
webhook that fails or is gone never fails the run it reports on."""

from __future__ import annotations

import pytest

from tasks.notify import send, webhook_url
from training.config import Config
from training.errors import ConfigError

from .conftest import WebhookReceiver


def test_the_message_is_slack_compatible_json(monkeypatch) -> None:
    with WebhookReceiver() as hook:
        monkeypatch.setenv("TEAM_WEBHOOK", hook.url)
        assert send("env:TEAM_WEBHOOK", ":x: gradline run failed", "*step* `train`")
    (body,) = hook.bodies
    assert body["text"] == ":x: gradline run failed"
    assert [block["type"] for block in body["blocks"]] == ["section", "section"]
    assert body["blocks"][1]["text"] == {"type": "mrkdwn", "text": "*step* `train`"}


@pytest.mark.parametrize("broken", ["status 500", "nobody listening", "variable unset"])
def test_an_undeliverable_alert_is_logged_not_raised(monkeypatch, broken) -> None:
    warnings: list[str] = []
    with WebhookReceiver(status=500) as hook:
        url = {"status 500": hook.url, "nobody listening": "http://127.0.0.1:9/hook"}
        if broken in url:
            monkeypatch.setenv("TEAM_WEBHOOK", url[broken])
        else:
            monkeypatch.delenv("TEAM_WEBHOOK", raising=False)
        assert not send("env:TEAM_WEBHOOK", "text", "details", warn=warnings.append)
    (warning,) = warnings
    assert warning.startswith("notification (env:TEAM_WEBHOOK) not delivered")
    if broken == "variable unset":
        assert "environment variable TEAM_WEBHOOK is not set" in warning


def test_params_name_where_the_url_is_kept_never_the_url() -> None:
    with pytest.raises(ValueError, match="a webhook URL is a credential"):
        Config.model_validate({"orchestrate": {"notify": "https://hooks.slack.com/x/y"}})
    with pytest.raises(ValueError, match="give env:NAME"):
        Config.model_validate({"orchestrate": {"notify": "slack"}})
    for target in ("", "env:GRADLINE_WEBHOOK", "block:team-alerts"):
        assert (
            Config.model_validate({"orchestrate": {"notify": target}}).orchestrate.notify == target
        )
    with pytest.raises(ConfigError, match="is not set"):
        webhook_url("env:GRADLINE_TEST_NOTHING_HERE")


def test_a_new_champion_and_a_failure_carry_their_links_and_cause(monkeypatch) -> None:
    from tasks.notify import notify_champion, notify_failure
    from tasks.registry import RunSummary
    from training.errors import DiskFull

    summary = RunSummary(
        status="completed", data_version="md5", run_id="abc123", run_url="http://ui/#/runs/abc123",
        experiment="gradline", tracking_uri="sqlite:///x", model_name="gradline-digits",
        version=7, version_url="http://ui/#/models/gradline-digits/versions/7",
        alias="champion", metrics={"test_accuracy": 0.99, "baseline_test_accuracy": 0.97},
        verdict="champion: test_accuracy 0.9900 beats the champion's 0.9800. Details",
    )  # fmt: skip
    with WebhookReceiver() as hook:
        monkeypatch.setenv("TEAM_WEBHOOK", hook.url)
        notify_champion("env:TEAM_WEBHOOK", "/srv/project", summary)
        notify_failure("env:TEAM_WEBHOOK", "/srv/project", "train", DiskFull("no space left"))
    champion, failure = hook.bodies
    assert champion["text"] == ":trophy: new champion: gradline-digits v7 (project)"
    details = champion["blocks"][1]["text"]["text"]
    assert "<http://ui/#/models/gradline-digits/versions/7|gradline-digits v7>" in details
    assert "<http://ui/#/runs/abc123|abc123>" in details and "test_accuracy=0.9900" in details
    assert "baseline" not in details and "beats the champion's 0.9800" in details
    assert failure["text"] == ":x: gradline run failed in `train` (project)"
    assert "DiskFull: no space left" in failure["blocks"][1]["text"]["text"]
    assert "a retry would fail the same way" in failure["blocks"][1]["text"]["text"]
