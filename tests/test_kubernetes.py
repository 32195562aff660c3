"""ops/kubernetes, validated offline: every resource against the Kubernetes schemas
(kubernetes-validate) or its CRD's schema (stored in ops/kubernetes/crds), and the settings that
must agree with surge and with each other."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from surge import metrics
from surge.config_load import load_config

K8S = Path(__file__).parent.parent / "ops" / "kubernetes"
VERSION = "1.30"  # the oldest Kubernetes still supported upstream when this was written
CRDS = {(crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"]):
        version["schema"]["openAPIV3Schema"]
        for path in (K8S / "crds").glob("*.yaml")
        for crd in [yaml.safe_load(path.read_text())]
        for version in crd["spec"]["versions"]}


def _resources(folder: Path) -> list[dict]:
    """What `kubectl apply -k folder` would send (resources and strategic-merge patches)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out: list[dict] = []
    for entry in kustomization["resources"]:
        path = folder / entry
        out += _resources(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for patch in kustomization.get("patches", []):
        change = yaml.safe_load((folder / patch["path"]).read_text())
        (target,) = [r for r in out if (r["kind"], r["metadata"]["name"]) ==
                     (change["kind"], change["metadata"]["name"])]
        _merge(target, change)
    return out


def _merge(into: dict, change: dict) -> None:
    """A strategic merge as far as these patches use it: maps merge, lists of named items
    merge by name, other values are replaced."""
    for key, value in change.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and value and \
                all(isinstance(v, dict) and "name" in v for v in value + old):
            for item in value:
                match = [o for o in old if o["name"] == item["name"]]
                _merge(match[0], item) if match else old.append(item)
        else:
            into[key] = value


def _validate(resource: dict) -> None:
    group, _, version = resource["apiVersion"].rpartition("/")
    schema = CRDS.get((group, version, resource["kind"]))
    if schema is not None:
        jsonschema.validate(resource, schema)
    else:
        kubernetes_validate.validate(resource, VERSION, strict=True)


BASE = _resources(K8S / "base")
GPU = _resources(K8S / "overlays" / "gpu")
AUTOSCALING = [yaml.safe_load(p.read_text()) for p in sorted((K8S / "autoscaling").glob("*.yaml"))]


@pytest.mark.parametrize("resource", BASE + GPU + AUTOSCALING,
                         ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_resource_is_valid(resource: dict) -> None:
    _validate(resource)


def test_crd_schemas_catch_mistakes() -> None:
    """The CRD schemas are strict enough to matter: a misspelt field is refused."""
    (scaled,) = [r for r in GPU if r["kind"] == "ScaledObject"]
    bad = {**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}}
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    (monitor,) = [r for r in BASE if r["kind"] == "ServiceMonitor"]
    bad = {**monitor, "spec": {**monitor["spec"], "endpoints": "http"}}
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)


def _one(resources: list[dict], kind: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("resources", [BASE, GPU], ids=["base", "gpu"])
def test_pod_matches_the_systemd_unit(resources: list[dict]) -> None:
    pod = _one(resources, "Deployment")["spec"]["template"]["spec"]
    (surge,) = pod["containers"]
    assert surge["readinessProbe"]["httpGet"]["path"] == "/health"
    assert surge["startupProbe"]["httpGet"]["path"] == "/health"
    # Liveness must not fail during a drain, when /health answers 503.
    assert surge["livenessProbe"]["httpGet"]["path"] != "/health"
    pause = int(surge["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(_flag(surge["args"], "--drain-timeout-s"))
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    assert _flag(surge["args"], "--port") == "8000"
    assert {"XDG_RUNTIME_DIR", "XDG_CACHE_HOME"} <= {e["name"] for e in surge["env"]}


def test_gpu_overlay_asks_for_a_gpu() -> None:
    (surge,) = _one(GPU, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert surge["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert _flag(surge["args"], "--device") == "cuda"
    assert surge["volumeMounts"]  # the patch merged into the base container, not replaced it


def test_config_map_is_a_surge_config(tmp_path: Path) -> None:
    path = tmp_path / "surge.toml"
    path.write_text(_one(BASE, "ConfigMap")["data"]["surge.toml"])
    cfg = load_config({"config": str(path)}, env={})
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
    for scaler in (_one(GPU, "ScaledObject"), _one(AUTOSCALING, "HorizontalPodAutoscaler")):
        assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


def test_autoscalers_use_metrics_surge_exports() -> None:
    exported = {m._name for m in vars(metrics).values() if hasattr(m, "_name")}
    keda = _one(GPU, "ScaledObject")
    queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    hpa = _one(AUTOSCALING, "HorizontalPodAutoscaler")
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    names |= {n for q in queries for n in re.findall(r"\bsurge_\w+", q)}
    assert names and names <= exported, names - exported
