"""Kubernetes manifests: every overlay renders, validates against the OpenAPI schemas offline, and
follows the project's policies."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# An overlay, or "overlay+component+...": the overlay with those k8s/components added (as an
# operator's own overlay would add them).
OVERLAYS = ["cpu", "gpu", "cpu+tls+api-keys"]
K8S_VERSION = "1.32.0"
PRE_STOP_S = 5
MODEL_SERVICES = ("specdec-drafter", "specdec-verifier")


def render(variant: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render k8s/overlays"
    overlay, *components = variant.split("+")
    with tempfile.TemporaryDirectory() as tmp:
        if components:  # kustomize wants relative paths: a kustomization beside, pointing back here
            rel = os.path.relpath(ROOT / "k8s", tmp)
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": [f"{rel}/overlays/{overlay}"],
                "components": [f"{rel}/components/{c}" for c in components]}))
            target = tmp
        else:
            target = str(ROOT / "k8s" / "overlays" / overlay)
        out = subprocess.run([kubectl, "kustomize", target], check=True, capture_output=True, text=True).stdout
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
            "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"} <= kinds
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


def test_model_services_take_their_threads_from_their_cpu_request(rendered):
    """torch sizes its thread pool by the node's cores, not the pod's CPU share: on CPUs the drafter
    and the verifier get SPECDEC_THREADS from their own CPU request, and the CLI reads it. Beside a
    GPU it is 0, which the services take as one thread (``service_threads``)."""
    from specdec.cli import build_parser
    from specdec.service_config import service_config

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
    assert service_config(build_parser().parse_args(["serve", "drafter"]), {"SPECDEC_THREADS": "3"}).threads == 3
    assert service_config(build_parser().parse_args(["serve", "drafter", "--threads", "2"]),
                          {"SPECDEC_THREADS": "3"}).threads == 2  # the flag wins
    # 0 (the GPU overlays' value, or none set): one thread beside a GPU, torch's default on a CPU
    for env in ({"SPECDEC_THREADS": "0"}, {}):
        assert service_config(build_parser().parse_args(["serve", "verifier", "--device", "cpu"]), env).threads is None
        assert service_config(build_parser().parse_args(["serve", "verifier", "--device", "cuda"]), env).threads == 1


# -- who may call whom -------------------------------------------------------------------------------

def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_templates(objects) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in deployments(objects)}


def test_network_policies_let_only_gateways_reach_the_model_services(rendered):
    """Default deny for drafter and verifier pods; their gRPC port from gateway pods of the
    namespace only, their metrics port from the monitoring namespace only, nothing else."""
    _, objects = rendered
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = pod_templates(objects)
    gateway_labels = pods["specdec-gateway"]["metadata"]["labels"]
    for name in MODEL_SERVICES:
        labels = pods[name]["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for p in pods[name]["spec"]["containers"][0]["ports"]}
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert all(p["metadata"]["namespace"] == "specdec" for p in selecting)
        assert any(p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress") for p in selecting), \
            f"{name}: no default-deny ingress policy"
        allowed: dict[int, list[dict]] = {}
        for policy in selecting:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress") or []:
                # A rule without "from" admits every source, one without "ports" every port.
                assert rule.get("from") and rule.get("ports"), f"{policy['metadata']['name']}: too open"
                for port in rule["ports"]:
                    assert port.get("protocol", "TCP") == "TCP"
                    number = ports[port["port"]] if isinstance(port["port"], str) else port["port"]
                    assert number in ports.values(), f"{name}: a policy names a port the pod lacks"
                    allowed.setdefault(number, []).extend(rule["from"])
        assert set(allowed) == {ports["grpc"], ports["metrics"]}, name
        for peer in allowed[ports["grpc"]]:
            assert set(peer) == {"podSelector"}, f"{name}: gRPC open beyond this namespace's pods"
            assert selects(peer["podSelector"], gateway_labels)
            assert not any(selects(peer["podSelector"], pods[other]["metadata"]["labels"]) for other in MODEL_SERVICES)
        for peer in allowed[ports["metrics"]]:
            assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    # The gateway is the public entry: no policy isolates it.
    assert not any(selects(p["spec"]["podSelector"], gateway_labels) for p in policies)


def test_every_service_reads_the_service_token_from_the_operators_secret(rendered, tmp_path):
    """Gateway, drafter and verifier take the token from Secret specdec-service-token (mounted as a
    file, not optional: without it a pod waits instead of starting open). The manifests hold no
    Secret: the operator creates it (docs/kubernetes.md)."""
    from specdec.service_config import service_tokens

    _, objects = rendered
    assert not [o for o in objects if o["kind"] == "Secret"], "secret material does not belong in the repository"
    for name, template in pod_templates(objects).items():
        if not name.startswith("specdec-"):
            continue
        pod, container = template["spec"], template["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert "SPECDEC_SERVICE_TOKEN" not in env, f"{name}: a literal token"
        path = env["SPECDEC_SERVICE_TOKEN_FILE"]["value"]
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
        assert mount.get("readOnly") is True
        secret = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
        assert secret["secretName"] == "specdec-service-token" and not secret.get("optional"), name
        assert secret["defaultMode"] & 0o007 == 0, f"{name}: the token is world-readable"
        assert {"key": "token", "path": path[len(mount["mountPath"].rstrip("/")) + 1:]} in secret["items"], name
    token = tmp_path / "token"
    token.write_text("a-generated-token-of-43-characters-0123456\n")
    assert service_tokens({"SPECDEC_SERVICE_TOKEN_FILE": str(token)}) == [b"a-generated-token-of-43-characters-0123456"]


def test_tls_component_secures_every_hop(rendered):
    """With k8s/components/tls: each service serves its own certificate; drafters and verifiers
    require a client certificate from the CA naming the gateway; probes go to a plaintext
    health-only port (the kubelet's grpc probes cannot speak TLS)."""
    from specdec.cli import build_parser
    from specdec.service_config import serve_options

    variant, objects = rendered
    if "tls" not in variant.split("+"):
        for template in pod_templates(objects).values():
            names = {e["name"] for e in template["spec"]["containers"][0].get("env", [])}
            assert not {"SPECDEC_TLS_CERT", "SPECDEC_HEALTH_PORT"} & names
        return
    for name, template in pod_templates(objects).items():
        if not name.startswith("specdec-"):
            continue
        pod, container = template["spec"], template["spec"]["containers"][0]
        # The pod's environment, less the token and key files, which only the pod has (tested above).
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e and not e["name"].endswith("_FILE")}
        options = serve_options(build_parser().parse_args(["serve", name.removeprefix("specdec-")]), env)
        tls = options.tls
        assert tls.enabled and tls.ca is not None
        mount = next(m for m in container["volumeMounts"] if str(tls.cert).startswith(m["mountPath"] + "/"))
        secret = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
        assert secret["secretName"] == f"{name}-tls"
        assert {tls.cert.name, tls.key.name, tls.ca.name} == {"tls.crt", "tls.key", "ca.crt"}  # cert-manager's keys
        if name in MODEL_SERVICES:
            assert tls.client_auth and options.allowed_peers == ("specdec-gateway.specdec.svc",), name
        else:
            assert not tls.client_auth and options.allowed_peers == ()
        health_port = options.health_port
        assert health_port and {"name": "health", "containerPort": health_port} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, f"{name}/{probe}"
    # The health port is no way in: the NetworkPolicies admit gRPC and metrics only (the kubelet's
    # probes come from the node, which NetworkPolicy always admits).


def test_api_keys_component_gives_the_gateway_its_keys(rendered):
    variant, objects = rendered
    gateway = pod_templates(objects)["specdec-gateway"]
    container = gateway["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    if "api-keys" not in variant.split("+"):
        assert "SPECDEC_API_KEYS_FILE" not in env
        return
    path = env["SPECDEC_API_KEYS_FILE"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    secret = next(v for v in gateway["spec"]["volumes"] if v["name"] == mount["name"])["secret"]
    assert secret["secretName"] == "specdec-api-keys" and not secret.get("optional")
    for name in MODEL_SERVICES:  # client keys stay at the gateway
        assert "SPECDEC_API_KEYS_FILE" not in {e["name"] for e in pod_templates(objects)[name]["spec"]["containers"][0]["env"]}
