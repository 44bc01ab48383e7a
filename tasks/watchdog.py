"""Watchdogs kept by the Prefect server, for what a run cannot report itself.

A run killed with SIGKILL, by the OOM killer or with its machine cannot say it died: its
flow run would stay `Running`. Flow runs send heartbeats (every
PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds, set in flows/environment.py), and these
automations, registered by `gradline serve`, `gradline deploy-train` and every run,
act on the server's side:

- silence: a gradline flow run that missed three heartbeats is marked `Crashed`;
- crash: a gradline flow run that ends `Crashed` (a silent one included) is sent to
  the alert webhook;
- stale schedule: a served deployment with a schedule and no successful run for
  `orchestrate.stale_after_h` hours is sent to the alert webhook.

Registering is idempotent: each automation has a fixed name and is replaced when its
definition changed (another heartbeat period, another webhook).
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect.blocks.webhook import Webhook
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import CallWebhook, ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore as Automation
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.settings import get_current_settings

from tasks.notify import webhook_url

# The flows gradline runs; other teams' flows on a shared server are left alone.
FLOWS = ["gradline", "gradline-train"]
MISSED_HEARTBEATS = 3
SILENCE = "gradline: crash silent flow runs"
CRASH_ALERT = "gradline: alert on crashed flow runs"
WEBHOOK_BLOCK = "gradline-alerts"
_ENDED = ["Completed", "Failed", "Cancelled", "Crashed"]

_RUNS = ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"})
_OURS = ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": FLOWS})


def heartbeat_s() -> int:
    """The heartbeat period flow runs use (Prefect's minimum is 30 s)."""
    return max(30, get_current_settings().flows.heartbeat_frequency or 30)


def ensure_watchdogs(notify: str = "") -> list[str]:
    """Register (or update) the silence and crash automations; their names."""
    block = _webhook_block(notify) if notify else None
    names = [_upsert(silence_automation(block))]
    if block is not None:
        names.append(_upsert(crash_alert_automation(block)))
    return names


def ensure_stale_alert(deployment_name: str, deployment_id: UUID, notify: str, hours: float):
    """Alert when the deployment has had no successful run for `hours`."""
    block = _webhook_block(notify)
    text = (
        f":hourglass: gradline deployment `{deployment_name}` has had no successful run in "
        f"{hours:g} h: its schedule is paused, its server or `gradline serve` is down, or "
        "every run failed"
    )
    return _upsert(
        Automation(
            name=f"gradline: stale schedule of {deployment_name}",
            description="alert when a scheduled deployment stops completing runs",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Completed"},
                match=_RUNS,
                match_related=ResourceSpecification(
                    {"prefect.resource.id": f"prefect.deployment.{deployment_id}"}
                ),
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(hours=hours),
            ),
            actions=[CallWebhook(block_document_id=block, payload=_slack_json(text))],
        )
    )


def silence_automation(block: UUID | None = None) -> Automation:
    """Crash a silent run, and tell the webhook (`block`) itself: the Crashed event it
    causes can reach the crash alert only after a quarter of an hour when the server
    restarted since the run's last state (Prefect holds an event back until it has seen
    the one before it, and forgets what it saw on a restart)."""
    period = heartbeat_s()
    silent = f"no heartbeat for {MISSED_HEARTBEATS * period} s"
    alert = (
        f":boom: gradline flow run `{{{{ flow_run.name }}}}` crashed: {silent}, its process "
        "died (killed, out of memory, or its machine was lost) (flow run {{ flow_run.id }})"
    )
    return Automation(
        name=SILENCE,
        description=(
            f"a gradline flow run that sent no heartbeat for {MISSED_HEARTBEATS} x "
            f"{period} s died without a word (SIGKILL, OOM, lost machine): mark it Crashed"
        ),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in _ENDED)},
            match=_RUNS,
            match_related=_OURS,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=MISSED_HEARTBEATS * period),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"{silent}: the process that ran this flow died (killed, out of "
                "memory, or its machine was lost); run again to resume from its last checkpoint",
            ),
            *([CallWebhook(block_document_id=block, payload=_slack_json(alert))] if block else []),
        ],
    )


def crash_alert_automation(block: UUID) -> Automation:
    text = (
        ":boom: gradline flow run `{{ flow_run.name }}` crashed: "
        "{{ flow_run.state.message }} (flow run {{ flow_run.id }})"
    )
    return Automation(
        name=CRASH_ALERT,
        description="send gradline flow runs that crashed to the alert webhook",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            # Silent runs: the silence automation alerts on them itself.
            match=ResourceSpecification(
                {
                    "prefect.resource.id": "prefect.flow-run.*",
                    "prefect.state-message": "!no heartbeat*",
                }
            ),
            match_related=_OURS,
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[CallWebhook(block_document_id=block, payload=_slack_json(text))],
    )


def _slack_json(text_template: str) -> str:
    # Rendered by the server's Jinja: `tojson` quotes whatever a state message holds.
    expression = _as_jinja_string(text_template)
    return '{"text": {{ (' + expression + ") | tojson }}}"


def _as_jinja_string(template: str) -> str:
    """'a {{ x }} b' as the Jinja expression "a " ~ (x) ~ " b"."""
    parts, rest = [], template
    while "{{" in rest:
        before, _, after = rest.partition("{{")
        expr, _, rest = after.partition("}}")
        parts += [repr(before), f"({expr.strip()})"]
    parts.append(repr(rest))
    return " ~ ".join(p for p in parts if p != "''")


def _webhook_block(notify: str) -> UUID:
    """The webhook block the server calls, holding the URL `orchestrate.notify` names
    (the server calls it, so it must know the URL; Prefect keeps it as a secret)."""
    block = Webhook(url=webhook_url(notify), allow_private_urls=True)
    return block.save(WEBHOOK_BLOCK, overwrite=True)


def _upsert(automation: Automation) -> str:
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation.name)
        wanted = automation.model_dump(mode="json")
        for old in existing:
            if old.model_dump(include=set(wanted), mode="json") == wanted:
                return automation.name  # already there, as wanted
        for old in existing:
            client.delete_automation(old.id)
        client.create_automation(automation)
    return automation.name
