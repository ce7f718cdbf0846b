"""`specrt triton --k8s`: Kubernetes manifests for replicas of a served bundle, checked against Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: no unknown field) and for what they must say: the serve command with the
bundle's options, readiness on Triton's health, every port behind the Service, an autoscaler on Triton's metrics."""

import subprocess
import sys

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (a dev dependency)")


def test_the_manifests_validate_and_serve_the_bundle_as_configured(demo_bundle, tmp_path):
    import yaml

    out = tmp_path / "specrt.yaml"
    run = subprocess.run([sys.executable, "-m", "specrt", "triton", "--bundle", str(demo_bundle), "--out",
                          str(tmp_path / "repo"), "--method", "anpd", "--threads", "4", "--max-batch", "16",
                          "--instances", "2", "--k8s", str(out), "--replicas", "3", "--max-replicas", "6",
                          "--image", "registry.example/specrt:1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out} (Deployment, Service, HorizontalPodAutoscaler)" in run.stdout
    assert "--k8s" not in run.stdout.split("serve it with")[1]  # the serve line is `specrt serve`'s own flags
    docs = list(yaml.safe_load_all(out.read_text()))
    assert "&id" not in out.read_text()  # written out plainly, no YAML anchors
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    deployment, service, autoscaler = docs
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:4] == ["specrt", "serve", "--bundle", f"/models/{demo_bundle.name}"]
    flags = " ".join(command)
    for flag in ("--host 0.0.0.0", "--threads 4", "--method anpd", "--max-batch 16", "--instances 2",
                 "--openai-port=9000"):
        assert flag in flags
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["image"] == "registry.example/specrt:1" and deployment["spec"]["replicas"] == 3
    assert container["resources"]["requests"]["cpu"] == "4"
    assert pod["volumes"][0]["persistentVolumeClaim"]["readOnly"] is True
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc", "metrics", "openai"}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    spec = autoscaler["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"], spec["scaleTargetRef"]["name"]) == (3, 6, deployment["metadata"]["name"])
    assert spec["metrics"][0]["pods"]["metric"]["name"] == "specrt_queue_requests"


def test_a_wrong_manifest_fails_the_schema_check():
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                                      "spec": {"replicas": "three", "selector": {}, "template": {}}}, "1.30.0",
                                     strict=True)
