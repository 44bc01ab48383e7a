"""Drift before retraining: new data against the data the current champion learned from.

Where the pieces live:
- ingest profiles each data version (training.data.profile) into data/profile.json, a
  DVC output versioned with the data, and compares it with the champion's profile:
  the `drift` section of data/ingest.json (`check_new_data`);
- registration logs the profile and that section on the job's MLflow run
  (`record_drift`: artifacts drift/profile.json and drift/summary.json, metrics
  drift_psi_max, drift_label_psi or drift_js), so a champion's reference outlives
  data/; the gate's verdict names the drift (`drift_line`);
- the flow applies orchestrate.drift after ingest (`decide`): warn, or block before
  training unless the drift was accepted (`gradline run --accept-drift`, remembered per
  data version in .gradline/).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.atomic import write_json
from training.config import Config
from training.config.sections import OrchestrateConfig
from training.data.drift import compare, not_comparable, over_threshold
from training.data.profile import PROFILE_VERSION, Shape, profile_raw
from training.mlops.registry import CHAMPION, NO_CHAMPION_CODES
from training.mlops.tracking import TAG_DATA_VERSION, client, redact_uri, tracking_reachable
from training.mlops.versioning import data_version
from training.project import Project

ARTIFACT_DIR = "drift"
PROFILE_ARTIFACT = f"{ARTIFACT_DIR}/profile.json"
SUMMARY_ARTIFACT = f"{ARTIFACT_DIR}/summary.json"
TAG_STATUS = "gradline.drift.status"
TAG_CHAMPION = "gradline.drift.champion_version"
ACCEPTED_FILE = Path(".gradline") / "drift-accepted.json"

# What `status` in a drift section says.
CHECKED = "checked"
NO_CHAMPION = "no_champion"  # nothing to compare with: no check
NO_REFERENCE = "no_reference"  # the champion's run has no profile (registered before)
INCOMPARABLE = "incomparable"  # other kind of data, other features
UNAVAILABLE = "unavailable"  # the tracking server did not answer


@dataclass(frozen=True)
class Champion:
    model_name: str
    version: str
    run_id: str
    data_version: str

    def describe(self) -> dict[str, str]:
        return {
            "model": self.model_name,
            "version": self.version,
            "run_id": self.run_id,
            "data_version": self.data_version,
        }


def find_champion(tracking_uri: str, model_name: str) -> Champion | None:
    """The version holding `champion` and the data version its run trained on."""
    from mlflow.exceptions import MlflowException

    mlflow_client = client(tracking_uri)
    try:
        version = mlflow_client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code not in NO_CHAMPION_CODES:
            raise
        return None
    run = mlflow_client.get_run(version.run_id)
    return Champion(
        model_name, str(version.version), version.run_id, run.data.tags.get(TAG_DATA_VERSION, "")
    )


def run_artifact_json(tracking_uri: str, run_id: str, path: str) -> dict[str, Any] | None:
    """A JSON artifact of a run, or None when the run has none at `path`."""
    from mlflow.exceptions import MlflowException

    mlflow_client = client(tracking_uri)
    folder, _, name = path.rpartition("/")
    if name not in {Path(a.path).name for a in mlflow_client.list_artifacts(run_id, folder)}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = mlflow_client.download_artifacts(run_id, path, tmp)
        except (MlflowException, OSError):
            return None
        return json.loads(Path(local).read_text())


def _no_store_yet(tracking_uri: str) -> bool:
    """A local SQLite store that does not exist yet holds no champion (and is not
    created just to ask)."""
    prefix = "sqlite:///"
    return tracking_uri.startswith(prefix) and not Path(tracking_uri[len(prefix) :]).exists()


def _section(status: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"status": status, "message": message, **fields}


def check_new_data(
    project: Project, cfg: Config, raw_dir: Path, profile_path: Path
) -> dict[str, Any]:
    """Profile the snapshot in `raw_dir` into `profile_path` and compare it with the
    champion's data: the `drift` section of data/ingest.json. Never fails for want of
    a reference (no champion, a champion without a profile, other features, a server
    that does not answer): the section says why there was no check."""
    found = _champion_reference(project.tracking_uri, cfg.registry.model_name, raw_dir)
    reference = found[1] if isinstance(found, tuple) else None
    # One read of the data counts it on the reference's bins and samples its own.
    profile, counted = profile_raw(raw_dir, reference)
    write_json(profile_path, profile)
    if not isinstance(found, tuple) or counted is None:
        return found
    champion, reference = found
    return _checked(champion, compare(reference, counted), cfg.orchestrate)


def _champion_reference(
    uri: str, model: str, raw_dir: Path
) -> tuple[Champion, dict[str, Any]] | dict[str, Any]:
    """(the champion, the profile of its data) to compare with, or the drift section
    saying why there is none."""
    from mlflow.exceptions import MlflowException

    none_yet = _section(NO_CHAMPION, f"no champion of {model} yet: no drift check")
    if _no_store_yet(uri):
        return none_yet
    if not tracking_reachable(uri):
        return _section(
            UNAVAILABLE, f"the tracking server {redact_uri(uri)} did not answer: no drift check"
        )
    try:
        champion = find_champion(uri, model)
        if champion is None:
            return none_yet
        reference = run_artifact_json(uri, champion.run_id, PROFILE_ARTIFACT)
    except MlflowException as exc:
        return _section(UNAVAILABLE, f"the tracking store failed ({exc.message}): no drift check")
    who = f"champion v{champion.version} (run {champion.run_id})"
    if reference is None:
        return _section(
            NO_REFERENCE,
            f"{who} has no {PROFILE_ARTIFACT} (registered before drift checks): no drift "
            "check; the next version registered will carry one",
            champion=champion.describe(),
        )
    if why := _not_comparable(reference, raw_dir):
        return _section(
            INCOMPARABLE, f"no drift check against {who}: {why}", champion=champion.describe()
        )
    return champion, reference


def _not_comparable(reference: dict[str, Any], raw_dir: Path) -> str | None:
    """Why the champion's profile cannot be compared with the snapshot, or None."""
    if reference.get("version") != PROFILE_VERSION:
        return f"its profile has version {reference.get('version')}, not {PROFILE_VERSION}"
    return not_comparable(Shape.of_profile(reference), Shape.of_raw(raw_dir))


def _checked(
    champion: Champion, drift: dict[str, Any], orchestrate: OrchestrateConfig
) -> dict[str, Any]:
    """A drift section with a measurement: the champion, the figures, the thresholds
    at ingest and what passed them, and its line."""
    section = _section(CHECKED, "", champion=champion.describe(), **drift)
    section["thresholds"] = {
        "psi": orchestrate.drift_psi_threshold,
        "js": orchestrate.drift_js_threshold,
    }
    section["drifted"] = [[name, value] for name, value in _drifted(section, orchestrate)]
    section["message"] = drift_line(section, orchestrate)
    return section


def _drifted(drift: dict[str, Any], orchestrate: OrchestrateConfig) -> list[tuple[str, float]]:
    """What passed today's thresholds (a measured section only)."""
    if drift.get("status") != CHECKED:
        return []
    return over_threshold(drift, orchestrate.drift_psi_threshold, orchestrate.drift_js_threshold)


def drift_line(drift: dict[str, Any] | None, orchestrate: OrchestrateConfig) -> str:
    """One line for the gate's verdict and the logs, e.g. "drift vs champion v3: max PSI
    0.31 (feature x3), label PSI 0.01; above the 0.2 threshold: x3 0.31"; a section
    without a check says why there was none."""
    if not drift:
        return "no drift check (data/ingest.json has no drift section)"
    if drift["status"] != CHECKED:
        return drift["message"]
    head = f"drift vs champion v{drift['champion']['version']}"
    drifted = _drifted(drift, orchestrate)
    if drift["measure"] == "js":
        text = f"{head}: JS divergence {drift['js']:.3g} of byte unigrams"
        if drifted:
            text += f", above the {orchestrate.drift_js_threshold:g} threshold"
        return text
    text = f"{head}: max PSI {drift['psi_max']:.3g} (feature {drift['psi_max_feature']})"
    text += f", label PSI {drift['label_psi']:.3g}"
    if drifted:
        named = ", ".join(f"{name} {value:.3g}" for name, value in drifted[:5])
        more = f" and {len(drifted) - 5} more" if len(drifted) > 5 else ""
        text += f"; above the {orchestrate.drift_psi_threshold:g} threshold: {named}{more}"
    return text


@dataclass(frozen=True)
class Decision:
    blocked: bool
    drifted: bool
    message: str


def decide(
    drift: dict[str, Any] | None, orchestrate: OrchestrateConfig, accepted: bool
) -> Decision:
    """What orchestrate.drift does with an ingested data version's drift section: block
    only measured drift past a threshold, under `block`, and not accepted."""
    line = drift_line(drift, orchestrate)
    if not drift or not _drifted(drift, orchestrate):
        return Decision(False, False, line)
    if orchestrate.drift == "warn":
        return Decision(False, True, f"{line} (orchestrate.drift: warn, training goes on)")
    if accepted:
        return Decision(False, True, f"{line} (accepted with --accept-drift, training goes on)")
    return Decision(
        True,
        True,
        f"{line}. orchestrate.drift is block, so the run stopped before training: nothing "
        "was trained or registered. The new data is ingested; data/ingest.json lists "
        "every feature's drift. To train on it anyway, run `gradline run --accept-drift` "
        "(remembered for this data version), or set orchestrate.drift: warn, or raise "
        "orchestrate.drift_psi_threshold / drift_js_threshold",
    )


def _accepted_path(root: Path) -> Path:
    return root / ACCEPTED_FILE


def accepted_versions(root: Path) -> list[str]:
    path = _accepted_path(root)
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("data_versions", []))


def accept(root: Path, version: str) -> None:
    """Remember that the drift of data version `version` was accepted."""
    versions = accepted_versions(root)
    if version not in versions:
        write_json(_accepted_path(root), {"data_versions": [*versions, version]})


def ingested_drift(project: Project) -> dict[str, Any] | None:
    """The drift section of data/ingest.json, or None (not ingested, or before drift)."""
    if not project.ingest_report.is_file():
        return None
    return json.loads(project.ingest_report.read_text()).get("drift")


def record_drift(project: Project, cfg: Config, run_id: str) -> str:
    """Log the data profile and the drift section on the job's run (artifacts, metrics,
    tags) and return the line for the gate's verdict. Only when the project's data is
    the run's (its data version tag); otherwise both belong to other data: nothing."""
    from mlflow.entities import Metric, RunTag

    uri = project.tracking_uri
    mlflow_client = client(uri)
    version = data_version(project.root)
    if mlflow_client.get_run(run_id).data.tags.get(TAG_DATA_VERSION) != version:
        return ""
    if project.profile.is_file():
        mlflow_client.log_artifact(run_id, str(project.profile), ARTIFACT_DIR)
    drift = ingested_drift(project)
    if drift is None:
        return ""
    accepted = version in accepted_versions(project.root)
    summary = {**drift, "data_version": version, "accepted": accepted}
    mlflow_client.log_dict(run_id, summary, SUMMARY_ARTIFACT)
    tags = [RunTag(TAG_STATUS, drift["status"])]
    if "champion" in drift:
        tags.append(RunTag(TAG_CHAMPION, drift["champion"]["version"]))
    drifted = _drifted(drift, cfg.orchestrate)
    metrics = []
    if drift["status"] == CHECKED:
        values = (
            {"drift_js": drift["js"]}
            if drift["measure"] == "js"
            else {"drift_psi_max": drift["psi_max"], "drift_label_psi": drift["label_psi"]}
        )
        values["drift_over_threshold"] = len(drifted)
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, 0) for key, value in values.items()]
    mlflow_client.log_batch(run_id, metrics=metrics, tags=tags)
    if drift["status"] == NO_CHAMPION:
        return ""  # the verdict says "first champion" already
    line = drift_line(drift, cfg.orchestrate)
    return f"{line} (accepted with --accept-drift)" if accepted and drifted else line


def drift_summary(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """The drift recorded on a run at its registration (drift/summary.json): the data it
    trained on against the champion's when that data was ingested, i.e. the previous
    champion for a version that took the alias. None when the run has none. Keys:
    status, message (one line), champion {model, version, run_id, data_version}; when
    status is "checked", measure ("psi" or "js"), psi_max, psi_max_feature, label_psi,
    features [[name, psi], ...] most drifted first (tables) or js and top (text),
    thresholds, drifted, data_version, accepted."""
    return run_artifact_json(tracking_uri, run_id, SUMMARY_ARTIFACT)
