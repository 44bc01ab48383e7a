"""Alerts: a webhook told when a run fails or a new champion is crowned.

`orchestrate.notify` names where the webhook's URL is kept, never the URL itself
(params.yaml is committed; a webhook URL is a credential): `env:NAME` (an environment
variable of the process that runs the flow) or `block:NAME` (a Prefect Secret block).
The payload is Slack-compatible JSON (`text` plus one mrkdwn section), which Slack,
Mattermost, Rocket.Chat and most chat bridges accept. A notification that cannot be
delivered is logged and never fails the run it reports on.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
from prefect import get_run_logger
from prefect.blocks.system import Secret
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run

from tasks.prefect_api import lasting_api_url
from tasks.registry import RunSummary
from training.errors import ConfigError

_TIMEOUT_S = 10.0
_CAUSE_CHARS = 1500  # chat messages are short; the flow run holds the whole cause


def webhook_url(notify: str) -> str:
    """The URL that `orchestrate.notify` points to (the config checked its form)."""
    kind, _, name = notify.partition(":")
    if kind == "env":
        url = os.environ.get(name, "")
        if not url:
            raise ConfigError(
                f"orchestrate.notify={notify}: environment variable {name} is not set in the "
                "process that runs the flow (set it there, e.g. in the deployment's "
                "job_variables env, or use block:NAME)"
            )
        return url
    try:
        return str(Secret.load(name).get())
    except (ValueError, ObjectNotFound, httpx.HTTPError) as exc:
        raise ConfigError(
            f"orchestrate.notify={notify}: the Prefect Secret block {name!r} cannot be read "
            f"({exc}); create it with `prefect block create secret` or in the Prefect UI"
        ) from exc


def notify_failure(notify: str, root: str, step: str, exc: BaseException) -> None:
    """Tell the webhook that the run of `root` failed in `step`, and why."""
    cause = f"{type(exc).__name__}: {exc}"
    if len(cause) > _CAUSE_CHARS:
        cause = cause[:_CAUSE_CHARS] + " ..."
    retry = "a retry would fail the same way" if not getattr(exc, "retryable", True) else ""
    text = f":x: gradline run failed in `{step}` ({Path(root).name})"
    details = f"*project* `{root}`\n*step* `{step}`\n```{cause}```{_flow_run_line()}"
    send(notify, text, details + (f"\n{retry}" if retry else ""))


def notify_champion(notify: str, root: str, summary: RunSummary) -> None:
    """Tell the webhook that a new model version became the champion."""
    metrics = ", ".join(
        f"{k}={v:.4f}" for k, v in sorted(summary.metrics.items()) if not k.startswith("baseline_")
    )
    text = f":trophy: new champion: {summary.model_name} v{summary.version} ({Path(root).name})"
    details = (
        f"*model version* <{summary.version_url}|{summary.model_name} v{summary.version}>\n"
        f"*MLflow run* <{summary.run_url}|{summary.run_id}>\n*metrics* {metrics}\n"
        f"*gate* {summary.verdict.split('. ')[0]}{_flow_run_line()}"
    )
    send(notify, text, details)


def send(notify: str, text: str, details: str, warn: Callable[[str], None] | None = None) -> bool:
    """POST the message; True when the webhook took it. Never raises: an alert that
    cannot be delivered must not fail the run it reports on (`warn`, default the flow
    run's log, says why)."""
    payload = {"text": text, "blocks": [_section(text), _section(details)]}
    try:
        request = urllib.request.Request(
            webhook_url(notify),
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            response.read()
    except (ConfigError, OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        (warn or get_run_logger().warning)(f"notification ({notify}) not delivered: {exc}")
        return False
    return True


def _section(markdown: str) -> dict:
    return {"type": "section", "text": {"type": "mrkdwn", "text": markdown}}


def _flow_run_line() -> str:
    # No link into a temporary server's UI: it is gone when the alert is read.
    url = flow_run.ui_url if flow_run.id and lasting_api_url() else None
    return f"\n*flow run* <{url}|{flow_run.name}>" if url else ""
