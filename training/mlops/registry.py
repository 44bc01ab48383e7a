"""Model registry: a new version per training run, and a gate that moves `champion`.

The gate compares on the task's own metric in its own direction (accuracy up, RMSE or
loss down), always on the same test data:
- a model that does not beat its simple baseline (scored on the same split) is
  registered but never becomes `champion`, even when there is none yet;
- otherwise it becomes `champion` when there is none, or when it beats the champion.
When the test split changed since the champion was evaluated, the champion is scored
again on the current split. A champion that cannot take the current data (its input
schema changed) is not comparable: the verdict says so, and the new version is judged
against its baseline alone. The version's description says why it got its alias.

Registrations of one model name may run at once (two projects, one MLflow server), and
MLflow has no compare-and-set on aliases. So the gate runs as a queue ordered by version
number (see `register_and_gate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from training.config import Config
from training.mlops.filters import equals
from training.mlops.tracking import TAG_TEST_DIGEST, client, fluent_store


class Incompatible(Exception):
    """A model cannot score the current data (its task or its input changed); the
    message says why."""


CHAMPION = "champion"
CHALLENGER = "challenger"
GATE_TAG = "gradline.gate"  # the alias the gate gave this version; set last
# Registrations started together get their version numbers within this; a champion waits
# this long before asking whether later registrations are still in flight.
SETTLE_S = 1.0
# An ungated version registered this long before another is taken as cut short (its
# process died; it is gated on its next run), so it stops holding the queue.
STALE_S = 300.0
POLL_S = 0.2
ROUNDS = 5  # take-backs from a worse holder before reporting whatever holds the alias


@dataclass(frozen=True)
class Score:
    """The task's gate metric for the new model and its baseline on the same split."""

    metric: str  # e.g. test_accuracy
    higher_is_better: bool
    value: float
    baseline: float

    def beats(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b


@dataclass(frozen=True)
class Registration:
    model_name: str
    version: int
    alias: str
    score: Score
    champion_score: float | None  # the previous champion's, on the same test data
    verdict: str


NO_CHAMPION_CODES = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "PERMISSION_DENIED")


def gate_score(cfg: Config, metrics: dict[str, float]) -> Score:
    """The gate's view of metrics.json: the task's metric, its direction, its baseline."""
    card = cfg.task.card
    metric = card.gate_metric
    return Score(metric, card.higher_is_better, metrics[metric], metrics[f"baseline_{metric}"])


def _champion_score(
    mlflow_client, model_name: str, metric: str, test_digest: str, rescore
) -> tuple[str | None, float | None, str | None]:
    """(champion version, its score on this test data, why it could not be scored)."""
    from mlflow.exceptions import MlflowException

    try:
        champion = mlflow_client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException as exc:
        # No such model or alias yet; an auth server answers "permission denied" for a
        # model that does not exist. Anything else (the server is down) is an error.
        if exc.error_code not in NO_CHAMPION_CODES:
            raise
        return None, None, None
    run = mlflow_client.get_run(champion.run_id)
    if run.data.tags.get(TAG_TEST_DIGEST) == test_digest and metric in run.data.metrics:
        return champion.version, run.data.metrics[metric], None
    try:
        return champion.version, rescore(f"models:/{model_name}/{champion.version}"), None
    except Incompatible as exc:
        return champion.version, None, str(exc)


def decide(score: Score, champion: str | None, champion_score: float | None, why_not):
    """(alias, verdict) for a new version."""
    name = score.metric
    if not score.beats(score.value, score.baseline):
        also = ""
        if champion is not None and champion_score is not None:
            also = (
                f" (for comparison: champion v{champion}'s {champion_score:.4f} on the same "
                "test data)"
            )
        return CHALLENGER, (
            f"not champion: {name} {score.value:.4f} does not beat the baseline's "
            f"{score.baseline:.4f} on the same test split{also}"
        )
    versus = f"beats the baseline's {score.baseline:.4f}"
    if champion is None:
        return CHAMPION, f"champion: {name} {score.value:.4f} {versus}; first champion"
    if champion_score is None:
        return CHAMPION, (
            f"champion: {name} {score.value:.4f} {versus}; champion v{champion} cannot be "
            f"compared ({why_not}), so it is replaced"
        )
    if score.beats(score.value, champion_score):
        return CHAMPION, (
            f"champion: {name} {score.value:.4f} {versus} and champion v{champion}'s "
            f"{champion_score:.4f} on the same test data"
        )
    return CHALLENGER, (
        f"challenger: {name} {score.value:.4f} {versus} but not champion v{champion}'s "
        f"{champion_score:.4f} on the same test data"
    )


def register_and_gate(
    tracking_uri: str,
    model_name: str,
    model_uri: str,
    run_id: str,
    score: Score,
    test_digest: str,
    rescore: Callable[[str], float],
    tags: dict[str, str] | None = None,
    card_link: str | None = None,
    note: str = "",
) -> Registration:
    """Register the run's model (once) and give it its alias. `rescore(model_uri)` scores
    a champion on the current test split, or raises Incompatible. The description links
    `card_link` (the version's model card, written once the gate has decided). `note`
    (e.g. the drift of its data from the champion's) follows the verdict, in its first
    sentence.

    Concurrent registrations of one name: the registry hands out version numbers one at
    a time (distinct, increasing), so they order the registrants. Each gates only once
    every earlier version still in flight carries its gate tag (set after its alias), so
    the alias moves one registrant at a time, in version order, each against the
    champion the previous one left: the last holder beats every earlier one on the same
    test data, i.e. it is the best of them. A version that took `champion` waits
    SETTLE_S (unless no other version was registered within STALE_S: nobody is racing
    it) and then until no later version is in flight, and reads the alias again:
    if another version holds it, it is gated again against that one (a better model
    takes it back, a worse one becomes challenger and says so). So only the version
    holding `champion` when this returns reports it, and its run alone sends "new
    champion". What remains: a registration that gets its version after a champion's
    last look gates against that champion like any later run (two reports, both true in
    turn); an ungated version older than STALE_S (a crashed run, or a champion
    re-scored for longer than that) no longer holds the queue, so its gate may overlap
    another's, and the re-read after the alias moved settles it, but only for the
    overlaps it still sees; and a writer outside gradline can move the alias at will.
    """
    mlflow_client = client(tracking_uri)
    # Registering is idempotent per run: a pipeline re-run that trained nothing new
    # reports the version it already made instead of adding a duplicate. The gate's
    # verdict is tagged last, so a registration cut short is gated on the next run.
    version = version_of_run(mlflow_client, model_name, run_id)
    if version is not None:
        if GATE_TAG in version.tags:
            alias = ",".join(version.aliases) or "(no alias)"
            done = version.description or "gated before"
            return Registration(model_name, int(version.version), alias, score, None, done)
        if CHAMPION in version.aliases:  # cut short after the alias moved: it won
            mlflow_client.set_model_version_tag(model_name, version.version, GATE_TAG, CHAMPION)
            done = version.description or CHAMPION
            return Registration(model_name, int(version.version), CHAMPION, score, None, done)
    tags = {"gradline.run_id": run_id, **(tags or {})}
    if version is None:
        version = register_version(tracking_uri, model_name, model_uri, tags)
    for key, value in (
        (score.metric, score.value),
        (f"baseline_{score.metric}", score.baseline),
    ):
        mlflow_client.set_model_version_tag(model_name, version.version, key, f"{value:.6g}")
    gate = _Gate(
        mlflow_client, model_name, version.version, score, test_digest, rescore, tags, card_link
    )
    gate.note = note  # said after each verdict it gives
    gate.wait_for(lambda other: other < gate.version)
    alias, verdict, champion_score = gate.run()
    if alias == CHAMPION:
        alias, verdict, champion_score = gate.hold((alias, verdict, champion_score))
    return Registration(model_name, gate.version, alias, score, champion_score, verdict)


class _Gate:
    """One version's way through the gate queue (see `register_and_gate`)."""

    def __init__(
        self, mlflow_client, model_name, version, score, test_digest, rescore, tags, card_link
    ):
        self.client, self.model_name, self.score = mlflow_client, model_name, score
        self.version = int(version)
        self.test_digest, self.rescore, self.tags = test_digest, rescore, tags
        self.card_link = card_link
        self.note = ""
        # Says who is ahead while it waits, and stamps the server's clock on the version:
        # versions' ages are measured on that clock, not this machine's.
        self._describe(f"gate pending: waiting for registrations of {model_name} ahead")
        stamped = mlflow_client.get_model_version(model_name, str(self.version))
        self._server_ms, self._local = stamped.last_updated_timestamp, time.monotonic()

    def _now_ms(self) -> float:
        return self._server_ms + (time.monotonic() - self._local) * 1000

    def recent_others(self) -> list[str]:
        """Other versions of the model registered within STALE_S."""
        return [
            found.version
            for found in self.client.search_model_versions(equals(name=self.model_name))
            if int(found.version) != self.version
            and self._now_ms() - found.creation_timestamp < STALE_S * 1000
        ]

    def in_flight(self) -> list[int]:
        """Other versions of the model without a gate tag yet, registered within STALE_S."""
        # Search results leave tags out: ask the few recent versions themselves.
        return sorted(
            int(number)
            for number in self.recent_others()
            if GATE_TAG not in self.client.get_model_version(self.model_name, number).tags
        )

    def wait_for(self, which: Callable[[int], bool]) -> None:
        """Wait until no version picked by `which` is in flight (at most STALE_S: each
        drops out of `in_flight` by then anyway)."""
        deadline = time.monotonic() + STALE_S
        while any(which(other) for other in self.in_flight()) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def run(self) -> tuple[str, str, float | None]:
        """Gate against whoever holds `champion` now; move the alias, then the gate tag."""
        champion, champion_score, why_not = _champion_score(
            self.client, self.model_name, self.score.metric, self.test_digest, self.rescore
        )
        alias, verdict = decide(self.score, champion, champion_score, why_not)
        verdict = self._noted(verdict)
        self._describe(verdict)
        self.client.set_registered_model_alias(self.model_name, alias, self.version)
        self.client.set_model_version_tag(self.model_name, self.version, GATE_TAG, alias)
        return alias, verdict, champion_score

    def hold(self, result: tuple[str, str, float | None]) -> tuple[str, str, float | None]:
        """After taking `champion` (`result`): let the registrations behind it gate, then
        report `champion` only if this version still holds it; otherwise gate against
        the holder (take it back from a worse one, and look again)."""
        for round_ in range(ROUNDS):
            # With no other version registered lately, most likely nobody registers beside
            # this one; one that gets its version after this look gates against this
            # champion anyway (see register_and_gate). The usual lone run skips the wait.
            if round_ or self.recent_others():
                time.sleep(SETTLE_S)
            self.wait_for(lambda other: other > self.version)
            holder = self.client.get_model_version_by_alias(self.model_name, CHAMPION)
            if int(holder.version) == self.version:
                return result
            result = self.run()
            if result[0] != CHAMPION:
                return result
        return self._holding(result)

    def _holding(self, last: tuple[str, str, float | None]) -> tuple[str, str, float | None]:
        """The alias as it stands after ROUNDS take-backs (two holders scoring each other
        on different test data can each find the other worse)."""
        holder = self.client.get_model_version_by_alias(self.model_name, CHAMPION)
        if int(holder.version) == self.version:
            return last
        verdict = self._noted(
            f"challenger: v{holder.version} holds champion after {ROUNDS} take-backs"
        )
        self._describe(verdict)
        self.client.set_model_version_tag(self.model_name, self.version, GATE_TAG, CHALLENGER)
        return CHALLENGER, verdict, last[2]

    def _noted(self, verdict: str) -> str:
        return f"{verdict}; {self.note}" if self.note else verdict

    def _describe(self, verdict: str) -> None:
        self.client.update_model_version(
            self.model_name,
            self.version,
            description=_describe(self.tags, verdict, self.card_link),
        )


def register_version(tracking_uri: str, model_name: str, model_uri: str, tags=None):
    """A new version of `model_name` (created when missing) from a logged model's URI.
    Through the fluent API in `fluent_store`: MLflow resolves a `models:/<model id>` source
    through the process-wide tracking URI whichever client asks."""
    import mlflow

    with fluent_store(tracking_uri):
        return mlflow.register_model(model_uri, model_name, tags=tags)


def version_of_run(mlflow_client, model_name: str, run_id: str):
    """The model version registered from `run_id`, with its aliases and tags, or None.
    (Search results leave aliases and tags out; the version itself has them.)"""
    found = mlflow_client.search_model_versions(equals(name=model_name, run_id=run_id))
    return mlflow_client.get_model_version(model_name, found[0].version) if found else None


def is_gated(mlflow_client, model_name: str, run_id: str) -> bool:
    """Whether the run's model version exists and the gate has decided its alias."""
    version = version_of_run(mlflow_client, model_name, run_id)
    return version is not None and GATE_TAG in version.tags


def _describe(tags: dict[str, str], verdict: str, card_link: str | None = None) -> str:
    """The version's description in the registry: its verdict, where it came from, and a
    link to its model card (markdown: the UI renders it)."""
    lines = [
        f"{verdict[0].upper()}{verdict[1:]}.",
        f"Trained in MLflow run {tags['gradline.run_id']}.",
    ]
    if "gradline.data_version" in tags:
        lines.append(f"Data version (DVC md5 of data/raw): {tags['gradline.data_version']}.")
    if "gradline.git_commit" in tags:
        dirty = " with uncommitted changes" if tags.get("gradline.git_dirty") == "true" else ""
        lines.append(f"Code: git commit {tags['gradline.git_commit']}{dirty}.")
    if "gradline.prefect_flow_run_id" in tags:
        lines.append(f"Prefect flow run {tags['gradline.prefect_flow_run_id']}.")
    if card_link:
        lines.append(f"Model card: [model_card.md]({card_link}).")
    lines.append("`gradline lineage NAME/VERSION` prints the whole lineage.")
    return " ".join(lines)
