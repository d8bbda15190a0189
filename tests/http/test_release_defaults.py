"""Versions and safe defaults, as an operator meets them (issue "Ship it I").

Each test names what used to happen: no version anywhere but the package,
the shipped example admin token (or a short one) accepted silently, and
``/metrics`` open to anyone with every tenant's name and size.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from kvstore import __commit__, __version__
from tests.http.conftest import ADMIN, Api, Daemon, serving


async def test_status_and_metrics_name_the_build(api: Api) -> None:
    # Used to be: no version in /v1/admin/status nor in /metrics; then a version
    # every build shared (0.1.0) and no commit.
    assert __commit__ != "unknown" and re.fullmatch(r"[0-9a-f]{40}", __commit__)
    async with api.session.get(api.url("/v1/admin/status"), headers=api.auth(ADMIN)) as r:
        assert r.status == 200
        doc = await r.json()
        assert (doc["version"], doc["commit"]) == (__version__, __commit__)
    async with api.session.get(api.url("/metrics")) as r:
        text = await r.text()
    (line,) = [x for x in text.splitlines() if x.startswith("kvstore_build_info{")]
    assert f'version="{__version__}"' in line and f'commit="{__commit__}"' in line and line.endswith(" 1")


async def test_metrics_token_guards_metrics(tmp_path: Path) -> None:
    token = "metrics-token-of-the-tests-0123456789"
    async with serving(tmp_path, metrics_token=token) as api:
        session = api.session
        async with session.get(api.url("/metrics")) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "unauthorized"
        async with session.get(api.url("/metrics"), headers=api.auth("a-wrong-token-of-enough-length-000")) as r:
            assert r.status == 401
        for good in (token, ADMIN):  # the admin token works too
            async with session.get(api.url("/metrics"), headers=api.auth(good)) as r:
                assert r.status == 200
                assert "kvstore_build_info" in await r.text()
        async with session.get(api.url("/healthz")) as r:  # probes stay open
            assert r.status == 200


@pytest.mark.parametrize("labels", ["true", "false"])
async def test_tenant_labels_can_be_turned_off(tmp_path: Path, labels: str) -> None:
    # Used to be: /metrics named every tenant with its byte counts, always.
    async with serving(tmp_path, metrics_tenant_labels=labels) as api:
        session = api.session
        for name in ("acme-secret-customer", "globex-secret-customer"):
            token = await api.tenant(name)
            for i in range(3):
                async with session.put(
                    api.url(f"/v1/blocks/k{i}"), data=os.urandom(1000), headers=api.auth(token)
                ) as r:
                    assert r.status in (200, 201)
        async with session.get(api.url("/metrics")) as r:
            text = await r.text()
        requests = [x for x in text.splitlines() if x.startswith("kvstore_tenant_requests_total")]
        assert requests
        if labels == "true":
            assert "acme-secret-customer" in text and "globex-secret-customer" in text
        else:
            assert "secret-customer" not in text and 'tenant="' not in text
            # The series are summed, not dropped: 6 PUTs in one line.
            (line,) = requests
            assert line == "kvstore_tenant_requests_total 6", line


@pytest.mark.parametrize(
    ("setting", "token", "said"),
    [
        ("ADMIN_TOKEN", "replace-with-a-long-random-token", "example's placeholder"),
        ("ADMIN_TOKEN", "short-admin-token", "fewer than 32"),
        ("METRICS_TOKEN", "short-metrics-token", "fewer than 32"),
    ],
)
def test_weak_tokens_are_refused_at_start_up(daemon: Daemon, setting: str, token: str, said: str) -> None:
    # Used to be: the example admin token in deploy/kvstore.env.example was accepted silently.
    daemon.env["KVSTORE_" + setting] = token
    with pytest.raises(RuntimeError) as e:
        daemon.start()
    message = str(e.value)
    assert "exited with 2" in message
    assert setting.lower() in message and said in message
    assert token not in message  # a secret is never printed, even a bad one


def test_a_strong_token_starts(daemon: Daemon) -> None:
    daemon.env["KVSTORE_METRICS_TOKEN"] = "m" * 32
    daemon.start()
    assert daemon.stop(signal.SIGTERM) == 0
    assert re.search(r"kvstore serving on http://127\.0\.0\.1:\d+", daemon.output)
