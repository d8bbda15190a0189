"""log_format as a daemon writes it: every line of a json daemon's log
(stderr) is one JSON object, the recovery report at start-up is fields (not a dict's
repr) in both formats, and no secret reaches either."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import aiohttp

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.polling import until


async def _start_stop(daemon: Daemon) -> str:
    daemon.start()
    async with aiohttp.ClientSession() as session:

        async def ready() -> bool:
            async with session.get(daemon.base + "/readyz") as r:
                return r.status == 200

        await until("the daemon ready", ready)
        headers = {"Authorization": f"Bearer {ADMIN}"}
        body = {"name": "logs", "policy": "sealed"}
        async with session.post(daemon.base + "/v1/admin/tenants", json=body, headers=headers) as r:
            assert r.status == 201
        async with session.get(daemon.base + "/v1/admin/status", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status in (401, 403)
    assert daemon.stop(signal.SIGTERM) == 0, daemon.output
    return daemon.output


async def test_json_lines_and_the_recovery_report_as_fields(tmp_path: Path) -> None:
    env = daemon_env(tmp_path, log_format="json", log_level="debug")
    key = Path(env["KVSTORE_MASTER_KEY_FILE"]).read_bytes()
    output = await _start_stop(Daemon(tmp_path / "data", free_port(), env))
    # Every line of the log (stderr) is one object; stdout, in the same file
    # here, has the start-up contract's one line ("kvstore serving on ...").
    lines = [line for line in output.splitlines() if not line.startswith("kvstore serving on ")]
    assert len(lines) == len(output.splitlines()) - 1
    docs = [json.loads(line) for line in lines]
    assert docs and all({"time", "level", "logger", "message"} <= set(d) for d in docs)
    (opened,) = [d for d in docs if d["message"].startswith("store open at ")]
    assert opened["level"] == "info" and opened["logger"] == "kvstore.node"
    assert opened["index_rebuilt"] is False and opened["segments"] == 0 and opened["truncated"] == []
    for secret in (ADMIN, key.hex()):
        assert secret not in output


async def test_text_lines_give_the_recovery_report_as_key_value(tmp_path: Path) -> None:
    env = daemon_env(tmp_path)
    output = await _start_stop(Daemon(tmp_path / "data", free_port(), env))
    (opened,) = [line for line in output.splitlines() if " store open at " in line]
    assert " INFO kvstore.node: store open at " in opened
    assert "index_rebuilt=false segments=0 " in opened and "truncated=[]" in opened
    assert "{'" not in opened and ADMIN not in output
    assert os.environ.get("KVSTORE_LOG_FORMAT") is None  # (the default is text)
