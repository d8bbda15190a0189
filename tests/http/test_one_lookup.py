"""A GET asks the index once (issue 25). Regression: every GET looked its
key up twice (Store.head, then get_sendable) and counted two lookups in
kvstore_lookups_total; a PUT looked it up again for its ETag."""

from __future__ import annotations

import re

from tests.http.conftest import Api


async def _lookups(api: Api) -> float:
    async with api.session.get(api.url("/metrics")) as r:
        text = await r.text()
    m = re.search(r'^kvstore_lookups_total\{result="hit"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_get_is_one_lookup(api: Api) -> None:
    for policy in ("direct", "sealed"):
        auth = api.auth(await api.tenant(policy, policy))
        async with api.session.put(api.url("/v1/blocks/k"), data=b"x" * 100_000, headers=auth) as r:
            assert r.status == 201
            etag = r.headers["ETag"]
        before = await _lookups(api)
        async with api.session.get(api.url("/v1/blocks/k"), headers=auth) as r:
            assert r.status == 200 and await r.read() == b"x" * 100_000 and r.headers["ETag"] == etag
        async with api.session.get(api.url("/v1/blocks/k"), headers={**auth, "Range": "bytes=10-19"}) as r:
            assert r.status == 206 and await r.read() == b"x" * 10
        assert await _lookups(api) - before == 2, "two GETs, two lookups"
        async with api.session.put(api.url("/v1/blocks/k"), data=b"y", headers=auth) as r:
            assert r.status == 200 and r.headers["ETag"] == etag and (await r.json())["size"] == 100_000
