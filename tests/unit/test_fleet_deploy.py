"""deploy/fleet/: the Kubernetes manifests parse and hold together (the
StatefulSet's headless Service, probes on the daemon's health routes), and
every setting they and the systemd env example pass exists and loads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kvstore.server_config import SETTINGS, load

FLEET = Path(__file__).resolve().parents[2] / "deploy" / "fleet"
K8S = FLEET / "kvstore-fleet.k8s.yaml"
ENV = FLEET / "kvstore-fleet.env.example"
NOT_OURS = {"POD_NAME", "POD_NAMESPACE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def _docs() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(K8S.read_text()):
        out.setdefault(doc["kind"], []).append(doc)
    return out


def _container() -> dict[str, Any]:
    (sts,) = _docs()["StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_the_statefulset_has_its_headless_service_and_probes() -> None:
    docs = _docs()
    (sts,) = docs["StatefulSet"]
    services = {s["metadata"]["name"]: s for s in docs["Service"]}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"] == labels == sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["replicas"] >= 3
    c = _container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = c["ports"][0]["containerPort"]
    assert all(p["targetPort"] == port for s in services.values() for p in s["spec"]["ports"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert c["args"][c["args"].index("--data-dir") + 1] == mounts["data"]


def test_the_settings_they_pass_exist_and_load(tmp_path: Path) -> None:
    c = _container()
    env: dict[str, str] = {}
    for e in c["env"]:
        name = e["name"]
        if name in NOT_OURS:
            continue
        assert name.startswith("KVSTORE_"), name
        assert name.removeprefix("KVSTORE_").lower() in SETTINGS, name
        value = e.get("value")
        env[name] = "kvstore-0" if value == "$(POD_NAME)" else (value or "from-a-secret")
        env[name] = env[name].replace("$(POD_NAME)", "kvstore-0").replace("$(POD_NAMESPACE)", "kvstore")
    flags = [a for a in c["args"] if a.startswith("--")]
    assert all(f.removeprefix("--").replace("-", "_") in SETTINGS for f in flags)
    env.pop("KVSTORE_MASTER_KEY_FILE")  # a path in the pod
    cfg = load(None, env=env, flags={"data_dir": str(tmp_path)})
    assert cfg.store.fleet and cfg.store.node_id == "kvstore-0"
    assert cfg.store.advertise_url == "http://kvstore-0.kvstore-nodes.kvstore.svc:8420"
    assert cfg.store.fleet_dead_after_s >= 2 * cfg.store.fleet_heartbeat_s


def test_the_systemd_env_example_names_real_settings(tmp_path: Path) -> None:
    env = {}
    for line in ENV.read_text().splitlines():
        m = re.fullmatch(r"(# )?([A-Z0-9_]+)=(.*)", line.strip())  # commented out: an option, named right too
        if m is None or m[2] in NOT_OURS:
            continue
        assert m[2].removeprefix("KVSTORE_").lower() in SETTINGS, m[2]
        if not m[1]:
            env[m[2]] = m[3]
    cfg = load(None, env=env, flags={"data_dir": str(tmp_path)})
    assert cfg.store.fleet and cfg.store.node_id == "kv-0" and cfg.store.s3_bucket
