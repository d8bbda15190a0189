"""``GET /v1/keys``: a tenant's keys with their sizes, by prefix, a page at a time."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.http.conftest import ADMIN, Api


async def _list(api: Api, h: dict[str, str], **params: str) -> tuple[int, Any]:
    async with api.session.get(api.url("/v1/keys"), params=params, headers=h) as r:
        return r.status, await r.json()


async def test_pages_prefixes_and_sizes(api: Api) -> None:
    h = api.auth(await api.tenant("a"))
    other = api.auth(await api.tenant("b"))
    keys = {f"lmp@m@{i:03d}": b"x" * (i + 1) for i in range(25)} | {"other~1": b"y", "lmp@n@1": b"zz"}
    for k, v in keys.items():
        async with api.session.put(api.url(f"/v1/blocks/{k}"), data=v, headers=h) as r:
            assert r.status == 201
    status, doc = await _list(api, h)
    assert status == 200 and doc["next_start_after"] is None
    assert [(e["key"], e["size"]) for e in doc["keys"]] == sorted((k, len(v)) for k, v in keys.items())

    seen: list[str] = []
    after: str | None = None
    while True:
        params = {"prefix": "lmp@m@", "limit": "10"} | ({"start_after": after} if after else {})
        status, doc = await _list(api, h, **params)
        assert status == 200 and len(doc["keys"]) <= 10
        seen += [e["key"] for e in doc["keys"]]
        after = doc["next_start_after"]
        if after is None:
            break
    assert seen == sorted(k for k in keys if k.startswith("lmp@m@"))
    status, doc = await _list(api, h, prefix="lmp@m@02", start_after="lmp@m@021")
    assert [e["key"] for e in doc["keys"]] == ["lmp@m@022", "lmp@m@023", "lmp@m@024"]
    assert (await _list(api, other))[1] == {"keys": [], "next_start_after": None}


async def test_expired_keys_are_not_listed(api: Api) -> None:
    h = api.auth(await api.tenant("t"))
    async with api.session.patch(api.url("/v1/admin/tenants/t"), json={"ttl_s": 1}, headers=api.auth(ADMIN)) as r:
        assert r.status == 200
    async with api.session.put(api.url("/v1/blocks/old"), data=b"o", headers=h) as r:
        assert r.status == 201
    await asyncio.sleep(1.3)
    async with api.session.put(api.url("/v1/blocks/new"), data=b"n", headers=h) as r:
        assert r.status == 201
    assert [e["key"] for e in (await _list(api, h))[1]["keys"]] == ["new"]


async def test_bad_parameters_name_themselves(api: Api) -> None:
    h = api.auth(await api.tenant("p"))
    for params, field in (
        ({"limit": "0"}, "limit"),
        ({"limit": "10001"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"prefix": "a/b"}, "prefix"),
        ({"start_after": "a b"}, "start_after"),
        ({"after": "k"}, "after"),
    ):
        status, doc = await _list(api, h, **params)
        assert status == 400 and doc["error"]["code"] == "invalid_input" and field in doc["error"]["message"]
    async with api.session.get(api.url("/v1/keys")) as r:
        assert r.status == 401
