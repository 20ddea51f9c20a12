"""Kubernetes discovery: watch a Service's EndpointSlices and keep the set of ready pod addresses.

The gateway routes each new session to the least-loaded ready drafter/verifier pod itself (the
Services are headless), so it needs the live endpoint list rather than a ClusterIP. Outside a
cluster, static ``--verifier``/``--drafter`` addresses (or DNS names) are used instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("specdec.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def ready_addresses(endpoint_slice, port_name: str) -> set[str]:
    """``ip:port`` for every ready endpoint of one EndpointSlice (client object or dict)."""
    data = endpoint_slice if isinstance(endpoint_slice, dict) else endpoint_slice.to_dict()
    port = next((p.get("port") for p in data.get("ports") or [] if p.get("name") == port_name), None)
    if port is None:
        return set()
    out = set()
    for endpoint in data.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        # `ready` unset means ready (API contract); terminating endpoints report ready=false.
        if conditions.get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            out.add(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
    return out


class EndpointSliceWatcher:
    """Watches the EndpointSlices of one Service; calls ``on_change(addresses)`` on every change."""

    def __init__(self, api, namespace: str, service: str, on_change: Callable[[set[str]], None],
                 port_name: str = "grpc", watch_timeout_s: int = 300) -> None:
        self.api = api  # kubernetes.client.DiscoveryV1Api
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self._slices: dict[str, set[str]] = {}
        self._last: set[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def addresses(self) -> set[str]:
        return set().union(*self._slices.values()) if self._slices else set()

    def apply(self, event_type: str, endpoint_slice) -> None:
        """Fold one watch event (ADDED, MODIFIED, DELETED) into the address set."""
        name = endpoint_slice["metadata"]["name"] if isinstance(endpoint_slice, dict) else endpoint_slice.metadata.name
        if event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = ready_addresses(endpoint_slice, self.port_name)
        self._publish()

    def _publish(self) -> None:
        current = self.addresses
        if current != self._last:
            self._last = current
            log.info("%s endpoints: %s", self.service, sorted(current))
            self.on_change(current)

    def _relist(self) -> str:
        result = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}"
        )
        self._slices = {s.metadata.name: ready_addresses(s, self.port_name) for s in result.items}
        self._publish()
        return result.metadata.resource_version

    def run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                version = self._relist()
                stream = watch.Watch()
                for event in stream.stream(
                    self.api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
                    resource_version=version,
                    timeout_seconds=self.watch_timeout_s,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    self.apply(event["type"], event["object"])
                backoff = 0.5
            except ApiException as exc:  # 410 Gone: our version expired; relist
                log.warning("endpointslice watch for %s: %s", self.service, exc.reason)
            except Exception as exc:  # noqa: BLE001 - keep watching through API-server restarts
                log.warning("endpointslice watch for %s failed: %s", self.service, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"watch-{self.service}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def discovery_api(kubeconfig_host: str | None = None):
    """In-cluster config when running in a pod, else the local kubeconfig (or an explicit host)."""
    from kubernetes import client, config

    if kubeconfig_host:
        configuration = client.Configuration()
        configuration.host = kubeconfig_host
        return client.DiscoveryV1Api(client.ApiClient(configuration))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.DiscoveryV1Api()
