"""Kubernetes manifests for N replicas of a served bundle (`specrt triton --k8s FILE`).

Each replica is one pod running `specrt serve` (tritonserver, its decode-loop model and the OpenAI-compatible routes)
from an image of yours that has specrt and the server files installed, the bundle mounted read-only from a
PersistentVolumeClaim. The file holds, as one YAML stream:

    Deployment               the replicas; ports 8000 (HTTP), 8001 (gRPC), 8002 (metrics), 9000 (OpenAI routes);
                             readiness on Triton's /v2/health/ready (false while the model is not loaded, or is being
                             reloaded after its process died: serve.Revive), liveness on /v2/health/live, a startup
                             probe that gives the bundle `load_seconds` to load; CPU requested as the threads used;
                             annotations for Prometheus to scrape the metrics port
    Service                  one address in front of the ready replicas, every port
    HorizontalPodAutoscaler  between `replicas` and `max_replicas` on Triton's metrics: the requests waiting for a place in
                             a batch per pod (specrt_queue_requests, served to the autoscaler by a Prometheus adapter),
                             and CPU utilisation

The manifests are checked against Kubernetes' own OpenAPI schemas (kubernetes-validate) in the tests.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path

from specrt.config import option, to_flags
from specrt.files import write_atomic
from specrt.serving.triton import TritonConfig

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
MOUNT = "/models"


@dataclass(frozen=True)
class K8sConfig(TritonConfig):
    """`specrt triton`'s options: the repository's, and the manifests'."""

    k8s: Path | None = option(None, "also write Kubernetes manifests (Deployment, Service, autoscaler) for replicas "
                                    "of the served bundle to this YAML file")
    image: str = option("specrt:latest", "the container image (specrt and the Triton server files installed in it)")
    replicas: int = option(2, "replicas (the autoscaler's minimum)", ge=1)
    max_replicas: int = option(8, "the autoscaler's maximum replicas", ge=1)
    bundle_claim: str = option("specrt-bundles", "the PersistentVolumeClaim the bundle is read from (mounted at "
                                                 "/models; the bundle at /models/<its directory name>)")
    queue_target: float = option(2.0, "requests waiting for a place in a batch per pod the autoscaler holds to", gt=0)
    load_seconds: int = option(600, "seconds a pod may take to load the bundle before it counts as failed", ge=10)


def serve_args(cfg: TritonConfig, threads: int) -> list[str]:
    """`specrt serve`'s flags for the decode loop and backend options of `cfg` (those not at their defaults)."""
    defaults = {f.name: f.default for f in fields(TritonConfig) if f.name in ("bundle", "out")}
    plain = replace(TritonConfig.part_of(cfg), **defaults, threads=threads)
    return shlex.split(to_flags(plain))


def manifests(cfg: K8sConfig) -> list[dict]:
    """The Deployment, Service and HorizontalPodAutoscaler serving cfg.bundle (its directory name under the claim)
    with `specrt serve` and cfg's options; named after the bundle."""
    name = f"specrt-{Path(cfg.bundle).resolve().name}".lower().replace("_", "-")[:63].rstrip("-")
    threads = cfg.threads or 2
    labels = {"app.kubernetes.io/name": "specrt", "app.kubernetes.io/instance": name}
    command = ["specrt", "serve", "--bundle", f"{MOUNT}/{Path(cfg.bundle).resolve().name}", "--out", "/tmp/triton",
               "--host", "0.0.0.0", *serve_args(cfg, threads), *(f"--{k}-port={v}" for k, v in PORTS.items())]
    probe = (lambda path, period, failures: {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                                             "failureThreshold": failures, "timeoutSeconds": 2})
    container = {
        "name": "specrt", "image": cfg.image, "command": command,
        "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in PORTS.items()],
        "readinessProbe": probe("/v2/health/ready", 2, 1),
        "livenessProbe": probe("/v2/health/live", 10, 3),
        "startupProbe": probe("/v2/health/ready", 5, max(1, cfg.load_seconds // 5)),
        "resources": {"requests": {"cpu": str(threads)}, "limits": {"cpu": str(threads)}},
        "volumeMounts": [{"name": "bundles", "mountPath": MOUNT, "readOnly": True}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": cfg.replicas, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels, "annotations": {"prometheus.io/scrape": "true",
                                                           "prometheus.io/port": str(PORTS["metrics"])}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 60, "volumes": [
                {"name": "bundles", "persistentVolumeClaim": {"claimName": cfg.bundle_claim, "readOnly": True}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": k, "port": v, "targetPort": k, "protocol": "TCP"}
                                                      for k, v in PORTS.items()]}}
    autoscaler = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name, "labels": labels},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                 "minReplicas": cfg.replicas, "maxReplicas": max(cfg.replicas, cfg.max_replicas),
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "specrt_queue_requests"},
                                                       "target": {"type": "AverageValue",
                                                                  "averageValue": f"{cfg.queue_target:g}"}}},
                             {"type": "Resource", "resource": {"name": "cpu", "target": {
                                 "type": "Utilization", "averageUtilization": 80}}}]}}
    return [deployment, service, autoscaler]


def write_manifests(cfg: K8sConfig) -> list[dict]:
    """Write cfg.k8s (atomically); returns its documents."""
    import yaml

    class Plain(yaml.SafeDumper):  # every mapping written out where it is, no YAML anchors
        def ignore_aliases(self, data):
            return True

    docs = manifests(cfg)
    write_atomic(Path(cfg.k8s), yaml.dump_all(docs, Dumper=Plain, sort_keys=False))
    return docs
