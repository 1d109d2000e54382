"""Where the replicas are: a fixed list of URLs, or a Kubernetes Service's Endpoints.

`discover()` returns the replica base URLs now. For Kubernetes it reads the Service's Endpoints
through the official client (`kubernetes` package, in-cluster config first, then kubeconfig)
and lists the ready addresses only: a pod failing its readiness probe drops out by itself. The
API object is injectable, so tests pass a fake with `read_namespaced_endpoints`.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class StaticReplicas:
    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = [u.rstrip("/") for u in urls]

    async def discover(self) -> list[str]:
        return list(self.urls)


class KubernetesEndpoints:
    def __init__(self, service: str, namespace: str = "default", port_name: str | None = None, api=None) -> None:
        self.service = service
        self.namespace = namespace
        self.port_name = port_name
        self._api = api

    def _client(self):
        if self._api is None:
            try:
                from kubernetes import client, config  # noqa: PLC0415 - only with --k8s-service
            except ImportError as err:
                raise RuntimeError("--k8s-service needs the kubernetes client: pip install 'tokenforge[k8s]'") from err
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    async def discover(self) -> list[str]:
        endpoints = await asyncio.to_thread(self._client().read_namespaced_endpoints, self.service, self.namespace)
        return urls_of(endpoints, self.port_name)


def urls_of(endpoints, port_name: str | None) -> list[str]:
    """http://IP:PORT for every ready address of every subset (V1Endpoints or a look-alike)."""
    urls = []
    for subset in getattr(endpoints, "subsets", None) or []:
        ports = getattr(subset, "ports", None) or []
        port = next((p for p in ports if port_name is None or p.name == port_name), None)
        if port is None:
            continue
        for address in getattr(subset, "addresses", None) or []:
            host = f"[{address.ip}]" if ":" in address.ip else address.ip
            urls.append(f"http://{host}:{port.port}")
    return sorted(set(urls))
