"""Kubernetes manifests: every overlay renders, validates against the OpenAPI schemas offline, and
follows the project's policies."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ["cpu", "gpu"]
K8S_VERSION = "1.32.0"
PRE_STOP_S = 5


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render k8s/overlays"
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                         check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def deployments(objects):
    return [o for o in objects if o["kind"] == "Deployment"]


def test_every_object_validates_against_the_schema(rendered):
    _, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
            "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_schema_validation_catches_mistakes(rendered):
    _, objects = rendered
    broken = yaml.safe_load(yaml.safe_dump(deployments(objects)[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_containers_have_probes_resources_and_security(rendered):
    _, objects = rendered
    for deployment in deployments(objects):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            name = f"{deployment['metadata']['name']}/{container['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{name} lacks {probe}"
            assert container["resources"]["requests"] and container["resources"]["limits"], name
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert all(port.get("name") for port in container.get("ports", [])), f"{name}: unnamed port"


def test_specdec_probes_use_grpc_health(rendered):
    _, objects = rendered
    for deployment in deployments(objects):
        if not deployment["metadata"]["name"].startswith("specdec-"):
            continue
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        role = deployment["metadata"]["name"].removeprefix("specdec-")
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["grpc"]["service"] == f"specdec.v1.{role.capitalize()}"
        assert container["livenessProbe"]["grpc"]["service"] == "specdec.v1.Liveness"


def test_services_select_deployments_and_ports_resolve(rendered):
    _, objects = rendered
    pods = [(d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"]["containers"]) for d in deployments(objects)]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matches = [containers for labels, containers in pods if selector.items() <= labels.items()]
        assert matches, f"Service {service['metadata']['name']} selects no Deployment"
        port_names = {p["name"] for containers in matches for c in containers for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port.get("name"), f"{service['metadata']['name']}: unnamed port"
            assert port["targetPort"] in port_names
    for name in ("specdec-drafter", "specdec-verifier"):
        service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
        assert service["spec"]["clusterIP"] == "None", f"{name} must be headless for per-pod routing"


def test_grace_period_covers_prestop_and_drain(rendered):
    _, objects = rendered
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("specdec-config"))
    drain = float(config["data"]["DRAIN_SECONDS"])
    for deployment in deployments(objects):
        if not deployment["metadata"]["name"].startswith("specdec-"):
            continue
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRE_STOP_S)]
        assert "$(DRAIN_SECONDS)" in container["args"]
        assert pod["terminationGracePeriodSeconds"] >= PRE_STOP_S + drain + 5


def test_gpu_requests_only_in_gpu_overlay(rendered):
    overlay, objects = rendered
    for deployment in deployments(objects):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        if overlay == "gpu" and name in ("specdec-verifier", "specdec-drafter"):
            assert gpus == "1" and resources["requests"]["nvidia.com/gpu"] == gpus, "GPU requests must equal limits"
            pool = pod["nodeSelector"]["specdec.io/gpu-pool"]
            assert pool == ("large" if name == "specdec-verifier" else "small")
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        else:
            assert gpus is None and "nvidia.com/gpu" not in resources.get("requests", {}), f"{overlay}: {name} asks for a GPU"


def test_gateway_rbac_is_least_privilege(rendered):
    _, objects = rendered
    role = next(o for o in objects if o["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]
    gateway = next(d for d in deployments(objects) if d["metadata"]["name"] == "specdec-gateway")
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == "specdec-gateway"
    for deployment in deployments(objects):
        if deployment["metadata"]["name"] in ("specdec-verifier", "specdec-drafter"):
            account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            sa = next(o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == account)
            assert sa["automountServiceAccountToken"] is False


def test_otel_points_at_jaeger(rendered):
    _, objects = rendered
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("specdec-config"))
    endpoint = config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    host, port = re.match(r"http://([^:/]+):(\d+)", endpoint).groups()
    jaeger = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "jaeger")
    assert host.split(".")[0] == "jaeger" and host.split(".")[1] == jaeger["metadata"]["namespace"]
    assert int(port) in {p["port"] for p in jaeger["spec"]["ports"]} and int(port) == 4317
    assert 16686 in {p["port"] for p in jaeger["spec"]["ports"]}


def test_cli_accepts_the_manifest_args(rendered):
    """The container args parse with the real CLI (configmap values substituted)."""
    from specdec.cli import build_parser

    _, objects = rendered
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("specdec-config"))
    for deployment in deployments(objects):
        if not deployment["metadata"]["name"].startswith("specdec-"):
            continue
        args = [re.sub(r"\$\((\w+)\)", lambda m: config["data"][m.group(1)], a)
                for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]]
        parsed = build_parser().parse_args(args)
        assert parsed.command == "serve"


def test_model_services_take_their_threads_from_their_cpu_request(rendered, monkeypatch):
    """torch sizes its thread pool by the node's cores, not the pod's CPU share: on CPUs the drafter
    and the verifier get SPECDEC_THREADS from their own CPU request, and the CLI reads it. Beside a
    GPU it is 0, which the services take as one thread (``service_threads``)."""
    from specdec.cli import build_parser

    overlay, objects = rendered
    model_services = [d for d in deployments(objects) if d["metadata"]["name"] in ("specdec-verifier", "specdec-drafter")]
    assert len(model_services) == 2
    for deployment in model_services:
        name = deployment["metadata"]["name"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        if overlay == "gpu":
            assert env["SPECDEC_THREADS"] == {"name": "SPECDEC_THREADS", "value": "0"}, name
            continue
        ref = env["SPECDEC_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": container["name"], "resource": "requests.cpu", "divisor": "1"}, name
        assert container["resources"]["requests"]["cpu"], name
    monkeypatch.setenv("SPECDEC_THREADS", "3")
    assert build_parser().parse_args(["serve", "drafter"]).threads == 3
    monkeypatch.delenv("SPECDEC_THREADS")
    assert build_parser().parse_args(["serve", "verifier"]).threads == 0
