"""The S3 gateway's key prefixes (``s3~``, ``s3m~``) are not writable over
/v1: nothing a tenant writes there can pass for the gateway's state when a
node rebuilds its catalog from the records.

Regression (issue 24, found with the gateway's records): a direct tenant
could PUT blocks under ``s3m~`` over /v1, and a rebuild from the bucket read
them as that tenant's buckets and objects, a newer one taking another direct
tenant's bucket name.
"""

from __future__ import annotations

import json

from kvstore_client.wire import batchframe

from tests.http.conftest import Api


async def test_gateway_prefixes_are_refused_over_v1(api: Api) -> None:
    token = await api.tenant("d", "direct")
    auth = api.auth(token)
    for key in ("s3m~b~0123456789abcdef", "s3~0123~0"):
        async with api.session.put(api.url(f"/v1/blocks/{key}"), data=b"{}", headers=auth) as r:
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
            assert err["code"] == "invalid_key" and "S3 gateway" in err["message"]
        async with api.session.delete(api.url(f"/v1/blocks/{key}"), headers=auth) as r:
            assert r.status == 400
        async with api.session.get(api.url(f"/v1/blocks/{key}"), headers=auth) as r:
            assert r.status == 404  # reads are the tenant's own business: nothing is there
    body = batchframe.encode_put_stream([("ok-key", b"a"), ("s3m~o~x", b"b"), ("s3~y~0", b"c")])
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=auth) as r:
        assert r.status == 200, await r.text()
        results = json.loads(await r.read())["results"]
    assert [x["status"] for x in results] == [201, 400, 400]
    assert results[1]["error"]["code"] == "invalid_key"
    async with api.session.post(api.url("/v1/lookup"), json={"keys": ["ok-key", "s3m~o~x"]}, headers=auth) as r:
        assert (await r.json())["present"] == [True, False]
    async with api.session.put(api.url("/v1/blocks/s3-not-reserved~x"), data=b"z", headers=auth) as r:
        assert r.status == 201  # only the exact prefixes are the gateway's
