"""The Kubernetes manifests (deploy/k8s/, deploy/fleet/): valid for a current
Kubernetes, hardened, and a daemon that starts with what they give it.

Used to be: the fleet's Service named "kvstore" made Kubernetes give every
pod KVSTORE_PORT=tcp://..., KVSTORE_SERVICE_HOST, KVSTORE_PORT_8420_TCP...,
which the daemon refused as unknown settings (every pod exited, rc 2); its
master key, a Secret mounted with defaultMode 0400 under an fsGroup (0440),
was refused ("chmod 600", impossible on a Secret); no pod hardening.

The start-up test builds the container's environment from the single-node
manifest (its env, its Secret and ConfigMap as files at the modes Kubernetes
gives them, and the service-link variables of its Services, which Kubernetes
adds where enableServiceLinks is left on), then runs the daemon with it, in
the manifest's group. It runs as root here (this machine's interpreter is
under /root): the non-root user is the container image's test
(tests/deploy/), which runs the daemon as uid 10001.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.http.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = [ROOT / "deploy" / "k8s" / "kvstore.k8s.yaml", ROOT / "deploy" / "fleet" / "kvstore-fleet.k8s.yaml"]
KUBERNETES = kubernetes_validate.latest_version()
WRITTEN = ["/var/lib/kvstore", "/tmp"]  # where the daemon writes (data_dir; its workers' private files)


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pods(path: Path) -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in _docs(path) if d["kind"] in ("StatefulSet", "Deployment")]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_valid_for_a_current_kubernetes(path: Path) -> None:
    for doc in _docs(path):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on anything unknown or mistyped


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pods_are_hardened(path: Path) -> None:
    (pod,) = _pods(path)
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0 and ctx["fsGroup"] == ctx["runAsGroup"]
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert c["args"][0] == "serve" and "command" not in c  # the image's entrypoint, kvstore
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounted = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert set(WRITTEN) <= mounted, "every place the daemon writes is a writable volume"
    secret = next(v for v in pod["volumes"] if "secret" in v)
    assert secret["secret"]["defaultMode"] == 0o400


def _service_links(services: list[dict[str, Any]]) -> dict[str, str]:
    """The variables Kubernetes gives a pod for each Service (docker links'
    names), with a made-up cluster IP."""
    env: dict[str, str] = {}
    for i, svc in enumerate(services):
        name = svc["metadata"]["name"].upper().replace("-", "_")
        ip = f"10.96.0.{10 + i}"
        ports = svc["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for p in ports:
            proto, port = p.get("protocol", "TCP"), p["port"]
            if "name" in p:
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(port)
            base = f"{name}_PORT_{port}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{port}"
            env |= {f"{base}_PROTO": proto.lower(), f"{base}_PORT": str(port), f"{base}_ADDR": ip}
        env[f"{name}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
    return env


def _image_env() -> dict[str, str]:
    """The ENV of the container image's last stage."""
    text = (ROOT / "deploy" / "container" / "Containerfile").read_text().replace("\\\n", " ")
    last = text.rsplit("\nFROM ", 1)[1]
    env: dict[str, str] = {}
    for line in last.splitlines():
        if line.startswith("ENV "):
            env |= dict(pair.split("=", 1) for pair in line[4:].split())
    return env


def test_the_daemon_starts_with_what_the_single_node_manifest_gives_it(tmp_path: Path) -> None:
    path = MANIFESTS[0]
    docs = _docs(path)
    (pod,) = _pods(path)
    (c,) = pod["containers"]
    gid = pod["securityContext"]["fsGroup"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    # The container's paths, here.
    here = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}

    def local(value: str) -> str:
        for inside, outside in here.items():
            if value == inside or value.startswith(inside + "/"):
                return str(outside) + value[len(inside) :]
        return value

    for directory in ("data", "tmp"):
        here[mounts[directory]["mountPath"]].mkdir()
        os.chown(here[mounts[directory]["mountPath"]], -1, gid)
    # The Secret as Kubernetes mounts it: files in a timestamped folder behind ..data,
    # each key a symlink; defaultMode 0400 plus g+r for the fsGroup, root's, of that group.
    secret_dir = here[mounts["secrets"]["mountPath"]]
    payload = secret_dir / "..2026_11_27_00_00_00.000000001"
    payload.mkdir(parents=True)
    (payload / "master.key").write_bytes(os.urandom(32))
    (payload / "master.key").chmod(0o440)
    os.chown(payload / "master.key", 0, gid)
    (secret_dir / "..data").symlink_to(payload.name)
    (secret_dir / "master.key").symlink_to("..data/master.key")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    here[mounts["config"]["mountPath"]].write_text(config_map["data"][mounts["config"]["subPath"]])
    admin = secrets.token_urlsafe(32)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": str(here["/tmp"])}
    # The image's variables (deploy/container/Containerfile), listening here on
    # 127.0.0.1 instead of every address.
    image = _image_env()
    assert image["KVSTORE_LISTEN"] == "0.0.0.0:8420"
    port = free_port()
    env |= {k: local(v) for k, v in image.items() if k.startswith("KVSTORE_")} | {"KVSTORE_LISTEN": f"127.0.0.1:{port}"}
    for e in c["env"]:
        env[e["name"]] = local(e["value"]) if "value" in e else admin  # the one secretKeyRef: the admin token
    env |= _service_links([d for d in docs if d["kind"] == "Service"])
    assert "KVSTORE_PORT" in env and "KVSTORE_SERVICE_HOST" in env
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", *c["args"]],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            group=gid,
            extra_groups=[gid],
        )
    try:
        deadline = time.monotonic() + 60
        while "kvstore serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + c["readinessProbe"]["httpGet"]["path"], timeout=30) as r:
            assert r.status == 200
        create = urllib.request.Request(
            base + "/v1/admin/tenants",
            data=json.dumps({"name": "k8s"}).encode(),
            headers={"Authorization": f"Bearer {admin}"},
            method="POST",
        )
        with urllib.request.urlopen(create, timeout=30) as r:
            token = json.loads(r.read())["token"]
        block = os.urandom(300_000)
        auth = {"Authorization": f"Bearer {token}"}
        put = urllib.request.Request(base + "/v1/blocks/k8s-block", data=block, headers=auth, method="PUT")
        with urllib.request.urlopen(put, timeout=30) as r:
            assert r.status == 201
        with urllib.request.urlopen(urllib.request.Request(base + "/v1/blocks/k8s-block", headers=auth)) as r:
            assert r.read() == block
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, log.read_text()
    assert any(here["/var/lib/kvstore"].iterdir())  # the store is in the data volume
