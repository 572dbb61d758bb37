"""KubeRay manifests: they parse, carry the fields the RayJob / RayCronJob CRDs require, keep the dashboard inside the
cluster, and run the same job script as `ray job submit`."""

from __future__ import annotations

import shlex

import yaml

from pipeline.audit.run import load_job_config
from tests.data_paths import REPO

KUBE = REPO / "cluster" / "kuberay"


def _docs(name):
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


def _rayjob():
    docs = {d["kind"]: d for d in _docs("rayjob-audit.yaml")}
    return docs["RayJob"], docs["ConfigMap"]


def _check_rayjob_spec(spec):
    assert spec["entrypoint"] and spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert "rayStartParams" in head and head["template"]["spec"]["containers"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the driver, not agents, on the head
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # dashboard not exposed outside the cluster
    groups = cluster["workerGroupSpecs"]
    assert groups
    for g in groups:  # fields the CRD requires of a worker group
        for key in ("groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            assert key in g, key
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        (c,) = g["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one vLLM engine per GPU


def test_rayjob_parses_and_has_required_fields():
    job, _ = _rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["metadata"]["name"]
    _check_rayjob_spec(job["spec"])
    for doc in _docs("rayjob-audit.yaml") + _docs("raycronjob-nightly.yaml"):  # nothing exposes the dashboard
        assert doc["kind"] not in ("Ingress", "Service", "Route")


def test_entrypoint_is_the_ray_job_submit_script_and_its_config_loads(tmp_path):
    job, cm = _rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/nightly_audit.py"]
    # its `ray job submit` line
    assert "python jobs/nightly_audit.py" in (REPO / "jobs" / "nightly_audit.py").read_text()
    assert (REPO / argv[1]).exists()
    cfg_path = argv[argv.index("--config") + 1]
    mounts = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(cfg_path.startswith(m["mountPath"]) for m in mounts)
    (tmp_path / "audit.yaml").write_text(cm["data"]["audit.yaml"])
    cfg = load_job_config(tmp_path / "audit.yaml")  # the mounted config is a valid job config
    assert cfg.audit.agent == "vllm" and cfg.audit.gpus_per_actor == 1.0 and cfg.audit.executor == "ray"


def test_nightly_schedule_wraps_the_same_rayjob():
    (cron,) = _docs("raycronjob-nightly.yaml")
    assert cron["apiVersion"] == "ray.io/v1" and cron["kind"] == "RayCronJob"
    fields = cron["spec"]["schedule"].split()
    assert len(fields) == 5
    job, _ = _rayjob()
    assert cron["spec"]["jobTemplate"] == job["spec"]
    _check_rayjob_spec(cron["spec"]["jobTemplate"])
