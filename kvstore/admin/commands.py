"""What each admin command asks the daemon, and how its answer reads.

Each command is a function of the client and the parsed flags that makes
its calls and returns an :class:`Outcome`: the document ``--json`` prints
(the daemon's answer as it is), the text a person reads instead, a note for
stderr, the registry revision a change wrote (for ``--wait``) and a failure
the answer reports (damage found by verify).
"""

from __future__ import annotations

import argparse
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.admin import render
from kvstore.admin.client import Answer, Client
from kvstore.admin.errors import AdminError, Damaged, Refused, UsageError
from kvstore.admin.values import json_value
from kvstore.admin.wait import revision_of

FLUSH_SLACK_S = 30.0  # a flush answers within its timeout_s; this much more for the answer to come back


@dataclass
class Outcome:
    doc: Any
    text: str
    note: str = ""
    revision: int | None = None
    failure: AdminError | None = None


Command = Callable[[Client, argparse.Namespace], Outcome]


def _q(name: str) -> str:
    """A name as one path segment."""
    return urllib.parse.quote(name, safe="")


def _changed(answer: Answer, text: str, note: str = "") -> Outcome:
    return Outcome(answer.doc if answer.doc is not None else {}, text, note, revision_of(answer))


# -- tenants -------------------------------------------------------------------

LIMIT_FIELDS = {
    "quota": "quota_bytes",
    "ttl": "ttl_s",
    "frame_size": "frame_size",
    "events_topic": "events_topic",
    "admit_after": "admit_after",
    "admit_window": "admit_window_s",
    "eviction": "eviction",
}
QOS_FIELDS = {
    "weight": "weight",
    "read_bytes_per_s": "read_bytes_per_s",
    "write_bytes_per_s": "write_bytes_per_s",
    "requests_per_s": "requests_per_s",
}


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    """The body fields the limit, QoS and admission flags set."""
    body = _given(args, LIMIT_FIELDS)
    qos = _given(args, QOS_FIELDS)
    if args.qos_defaults:
        if qos:
            raise UsageError("--qos-defaults puts every QoS field back to the store's default: give no other with it")
        body["qos"] = None
    elif qos:
        body["qos"] = qos
    return body


def _given(args: argparse.Namespace, fields: dict[str, str]) -> dict[str, Any]:
    """The body ``fields`` whose flags were given (a flag's null word: null)."""
    return {field: json_value(getattr(args, flag)) for flag, field in fields.items() if getattr(args, flag) is not None}


def tenants_list(client: Client, args: argparse.Namespace) -> Outcome:
    doc = client.get("/v1/admin/tenants").doc
    rows = []
    for t in doc["tenants"]:
        reads, prefix = t["hits"]["reads"], t["hits"]["prefix_blocks"]
        rows.append(
            [
                t["name"],
                t["policy"],
                render.count(t["blocks"]),
                render.size(t["bytes_stored"]),
                render.size(t.get("quota_bytes")),
                render.duration(t.get("ttl_s")),
                render.count(reads["hit"]),
                render.count(reads["miss"]),
                render.ratio(prefix["hit"], prefix["miss"]),
            ]
        )
    headers = ["NAME", "POLICY", "BLOCKS", "STORED", "QUOTA", "TTL", "READ HITS", "READ MISSES", "PREFIX HITS"]
    text = render.table(headers, rows, numeric=range(2, 9)) if rows else "no tenants"
    return Outcome(doc, text)


def tenants_show(client: Client, args: argparse.Namespace) -> Outcome:
    doc = client.get(f"/v1/admin/tenants/{_q(args.name)}").doc
    return Outcome(doc, tenant_text(doc))


def tenant_text(t: dict[str, Any]) -> str:
    """A tenant with its usage, as key and value lines."""
    qos, rates = t.get("qos", {}), t.get("rates", {})
    reads, prefix = t["hits"]["reads"], t["hits"]["prefix_blocks"]
    admit = t.get("admit_after", 1)
    admission = (
        "every block at its first offer"
        if admit == 1
        else f"a block at its offer number {admit} within {render.duration(t.get('admit_window_s'))}"
    )

    def limit(n: int) -> str:
        return "no limit" if not n else f"{render.size(n)}/s"

    rows = [
        ("name", t["name"]),
        ("policy", f"{t['policy']} (compression {t['compression']}), {t['durability']}"),
        ("created", render.when(t["created_ns"])),
        ("key version", str(t["key_version"])),
        ("blocks", render.count(t["blocks"])),
        ("bytes stored", f"{render.size(t['bytes_stored'])} (logical {render.size(t['bytes_logical'])})"),
        ("quota", render.size(t.get("quota_bytes"))),
        ("ttl", render.duration(t.get("ttl_s"))),
        ("frame size", render.size(t.get("frame_size"), none="the store's")),
        ("events topic", t.get("events_topic") or f"{t['name']} (its name)"),
        ("admission", admission),
        ("eviction", t.get("eviction") or "the node's quota_eviction"),
        (
            "qos",
            f"weight {qos.get('weight')}; reads {limit(qos.get('read_bytes_per_s', 0))}, "
            f"writes {limit(qos.get('write_bytes_per_s', 0))}, requests "
            + (f"{qos['requests_per_s']}/s" if qos.get("requests_per_s") else "no limit"),
        ),
        (
            "rates now",
            f"reads {render.size(rates.get('read_bytes_per_s', 0))}/s, "
            f"writes {render.size(rates.get('write_bytes_per_s', 0))}/s, "
            f"{rates.get('requests_per_s', 0):.1f} requests/s",
        ),
        (
            "read hits",
            f"{render.count(reads['hit'])} of {render.count(reads['hit'] + reads['miss'])} block reads "
            f"({render.ratio(reads['hit'], reads['miss'])})",
        ),
        (
            "prefix hits",
            f"{render.count(prefix['hit'])} of {render.count(prefix['hit'] + prefix['miss'])} blocks "
            f"({render.ratio(prefix['hit'], prefix['miss'])})",
        ),
        ("tokens", ", ".join(x["id"] for x in t.get("tokens", [])) or "none"),
        ("s3 keys", ", ".join(x["access_key_id"] for x in t.get("s3_keys", [])) or "none"),
    ]
    return render.pairs(rows)


def tenants_create(client: Client, args: argparse.Namespace) -> Outcome:
    body: dict[str, Any] = {"name": args.name, "policy": args.policy}
    if args.compression is not None:
        body["compression"] = args.compression
    if args.durability is not None:
        body["durability"] = args.durability
    body |= _changes(args)
    answer = client.call("POST", "/v1/admin/tenants", body)
    doc = answer.doc
    note = f"created tenant {doc['name']} ({doc['policy']}); its token {doc['token_id']} is shown once: keep it"
    return _changed(answer, doc["token"], note)


def tenants_patch(client: Client, args: argparse.Namespace) -> Outcome:
    body = _changes(args)
    if not body:
        raise UsageError("nothing to change: give at least one of the flags 'kvstore admin tenants patch --help' lists")
    answer = client.call("PATCH", f"/v1/admin/tenants/{_q(args.name)}", body)
    return _changed(answer, tenant_text(answer.doc))


def tenants_delete(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("DELETE", f"/v1/admin/tenants/{_q(args.name)}")
    return _changed(answer, f"deleted tenant {args.name}: its keys are destroyed, its blocks unreadable")


def tenants_rotate_key(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("POST", f"/v1/admin/tenants/{_q(args.name)}/rotate-key")
    return _changed(answer, f"tenant {args.name}: new records use data key version {answer.doc['key_version']}")


# -- tokens and S3 keys ------------------------------------------------------------


def tokens_list(client: Client, args: argparse.Namespace) -> Outcome:
    doc = client.get(f"/v1/admin/tenants/{_q(args.tenant)}").doc
    tokens = doc.get("tokens", [])
    rows = [[x["id"], render.when(x["created_ns"])] for x in tokens]
    text = render.table(["TOKEN ID", "CREATED"], rows) if rows else f"tenant {args.tenant} has no tokens"
    return Outcome({"name": doc["name"], "tokens": tokens}, text)


def tokens_issue(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("POST", f"/v1/admin/tenants/{_q(args.tenant)}/tokens")
    note = f"issued token {answer.doc['token_id']} of tenant {args.tenant}; it is shown once: keep it"
    return _changed(answer, answer.doc["token"], note)


def tokens_revoke(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("DELETE", f"/v1/admin/tenants/{_q(args.tenant)}/tokens/{_q(args.token_id)}")
    return _changed(answer, f"revoked token {args.token_id} of tenant {args.tenant}")


def s3_keys_list(client: Client, args: argparse.Namespace) -> Outcome:
    doc = client.get(f"/v1/admin/tenants/{_q(args.tenant)}/s3-keys").doc
    rows = [[x["access_key_id"], render.when(x["created_ns"])] for x in doc["s3_keys"]]
    text = render.table(["ACCESS KEY ID", "CREATED"], rows) if rows else f"tenant {args.tenant} has no S3 keys"
    return Outcome(doc, text)


def s3_keys_issue(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("POST", f"/v1/admin/tenants/{_q(args.tenant)}/s3-keys")
    doc = answer.doc
    text = render.pairs([("access_key_id", doc["access_key_id"]), ("secret_access_key", doc["secret_access_key"])])
    return _changed(answer, text, f"issued an S3 key of tenant {args.tenant}; the secret is shown once: keep it")


def s3_keys_revoke(client: Client, args: argparse.Namespace) -> Outcome:
    answer = client.call("DELETE", f"/v1/admin/tenants/{_q(args.tenant)}/s3-keys/{_q(args.access_key_id)}")
    return _changed(answer, f"revoked S3 key {args.access_key_id} of tenant {args.tenant}")


# -- the node --------------------------------------------------------------------


def status(client: Client, args: argparse.Namespace) -> Outcome:
    doc = client.get("/v1/admin/status").doc
    return Outcome(doc, status_text(doc))


def status_text(s: dict[str, Any]) -> str:
    disk, backlog, fence, fleet = s.get("disk") or {}, s.get("upload_backlog"), s.get("fence") or {}, s.get("fleet")
    used, capacity = disk.get("used_bytes", 0), disk.get("capacity_bytes", 0)
    where = "its filesystem" if disk.get("measured") == "filesystem" else "its capacity setting"
    disk_line = (
        f"{render.size(used)} used of {render.size(capacity)} ({render.ratio(used, capacity - used)}; "
        f"{where}, {disk.get('path')}), high watermark {disk.get('high_watermark')}%"
    )
    if disk.get("full"):
        disk_line += "; FULL: writes are refused for space"
    fence_line = "not fenced"
    if fence.get("fenced"):
        fence_line = f"FENCED, writes refused: {fence.get('reason', '')}"
    if fence.get("tenants_fenced"):
        fence_line += f"; tenant operations refused: {fence.get('tenants_reason', '')}"
    nixl, rdma = s.get("nixl") or {}, s.get("rdma") or {}
    devices = rdma.get("devices", [])
    commit = s.get("commit")
    rows = [
        ("version", s["version"] + (f" (commit {commit[:12]})" if commit else "")),
        ("uptime", render.duration(s.get("uptime_s"))),
        ("process", f"{s['role']}, pid {s['pid']}; {s.get('workers')} worker{'s' if s.get('workers') != 1 else ''}"),
        ("disk", disk_line),
        (
            "upload backlog",
            "no object tier"
            if backlog is None
            else f"{render.count(backlog['segments'])} segments, {render.size(backlog['bytes'])}",
        ),
        ("object tier", tier_text(s.get("object_tier"))),
        ("fence", fence_line),
        (
            "fleet",
            "not in a fleet"
            if fleet is None
            else f"node {fleet['node_id']}, registry revision {fleet['registry_revision']}",
        ),
        ("nixl", f"on (agent {nixl.get('agent')}, {nixl.get('backend')})" if nixl.get("enabled") else "off"),
        (
            "rdma",
            ", ".join(sorted({d["device"] for d in devices}))
            if devices
            else f"no devices ({rdma.get('reason', 'none found')})",
        ),
    ]
    return render.pairs(rows)


def tier_text(tier: dict[str, Any] | None) -> str:
    """The status's ``object_tier``: whether the tier answers this node."""
    if tier is None:
        return "none (or not this process's to reach)"
    if tier.get("reachable"):
        return "reachable"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(tier.get("since", 0))))
    return f"UNREACHABLE since {since}, serving local data: {tier.get('error', '')}"


def flush(client: Client, args: argparse.Namespace) -> Outcome:
    bounded = client.bounded(args.flush_timeout + FLUSH_SLACK_S)
    doc = bounded.call("POST", "/v1/admin/flush", query={"timeout_s": f"{args.flush_timeout:g}"}).doc
    text = (
        "flushed: every open segment sealed, every sealed segment in the object tier"
        if doc.get("tier")
        else "flushed: every open segment sealed (no object tier)"
    )
    return Outcome(doc, text)


def compact(client: Client, args: argparse.Namespace) -> Outcome:
    query = {"tenant": args.tenant} if args.tenant else None
    doc = client.bounded(None).call("POST", "/v1/admin/compact", query=query).doc
    rows = [(k.replace("_", " "), str(v)) for k, v in doc.items() if k != "errors"]
    errors = doc.get("errors") or []
    rows.append(("errors", str(len(errors)) if errors else "none"))
    failure = None
    if errors:
        failure = Refused(f"compaction left {len(errors)} error(s); the first: {errors[0]}", 200, "compaction_errors")
    return Outcome(doc, render.pairs(rows), failure=failure)


def verify(client: Client, args: argparse.Namespace) -> Outcome:
    query = {"deep": "true"} if args.deep else None
    doc = client.bounded(None).call("POST", "/v1/admin/verify", query=query).doc
    errors = doc.get("errors") or []
    rows = [
        ("result", "ok" if doc.get("ok") else f"DAMAGE FOUND: {len(errors)} problem(s)"),
        ("segments", render.count(doc.get("segments", 0))),
        ("records", render.count(doc.get("records", 0))),
        ("bytes checked", render.size(doc.get("bytes_checked", 0))),
        ("frames opened", render.count(doc.get("frames_opened", 0))),
    ]
    text = render.pairs(rows)
    if errors:
        table = render.table(
            ["SEGMENT", "OFFSET", "ERROR"], [[str(e["segment"]), str(e["offset"]), str(e["error"])] for e in errors]
        )
        text += "\n\n" + table
    failure = None
    if not doc.get("ok"):
        first = (
            f"; the first: {errors[0]['segment']} at offset {errors[0]['offset']}: {errors[0]['error']}"
            if errors
            else ""
        )
        failure = Damaged(f"verify found damage, {len(errors)} problem(s){first}")
    return Outcome(doc, text, failure=failure)
