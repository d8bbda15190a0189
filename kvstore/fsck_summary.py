"""``kvstore fsck``'s report for people: what was checked, what the next
start would do, what is wrong, and the exit status, from the same document
``--json`` prints (kvstore/fsck.py builds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What the next start does about each finding of the plan (fsck.plan), in words.
_PLAN: dict[str, str] = {
    "unknown_tenants": "refuse to start: segments of tenant {} are not in the registry"
    " (discard_unknown_tenants = true would delete them)",
    "deleted_tenants_left": "remove what is left of deleted tenant {}",
    "missing_segments": "drop the index entries of {}: its file is gone and it is not in the object tier",
    "unindexed_segments": "index {}, which the index does not know",
    "abandoned_open_segments": "seal {}, an open segment that is not its tenant's newest",
    "retired_left": "remove {}, a segment compaction retired",
}
_SHOWN = 20  # items of one list shown; --json has them all


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _clip(items: list[str]) -> list[str]:
    if len(items) <= _SHOWN:
        return items
    return [*items[:_SHOWN], f"... and {len(items) - _SHOWN} more (--json lists them all)"]


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """What recovery would do at the next start, one line each."""
    out: list[str] = []
    if plan.get("index_missing"):
        out.append("rebuild the index from the segments (there is none)")
    if plan.get("trash"):
        out.append("finish removing deleted tenants' files (segments/.trash)")
    for tail in plan.get("torn_tails", []):
        if "error" in tail:
            out.append(f"cut {tail['segment']}, which cannot be opened: {tail['error']}")
        else:
            out.append(f"cut a torn tail of {tail['segment']} at offset {tail['offset']} ({tail['bytes']} bytes)")
    for key, text in _PLAN.items():
        out += [text.format(item) for item in plan.get(key, [])]
    return _clip(out)


def _recovery_lines(recovery: dict[str, Any]) -> list[str]:
    out = []
    if recovery.get("index_rebuilt"):
        out.append("rebuilt the index")
    counts = ("segments", "segments_from_footer", "segments_from_tier", "records_replayed", "entries_dropped")
    figures = [f"{key.replace('_', ' ')}: {recovery[key]}" for key in counts if recovery.get(key)]
    if figures:
        out.append(", ".join(figures))
    for tail in recovery.get("truncated", []):
        out.append(f"cut a torn tail of {tail['segment']} at offset {tail['offset']} ({tail['bytes']} bytes)")
    for bad in recovery.get("corrupt", []):
        out.append(f"corrupt: {bad['segment']} at offset {bad['offset']}: {bad['error']}")
    for key in ("sealed", "orphans_removed", "retired_removed"):
        items = recovery.get(key, [])
        if items:
            out.append(f"{key.replace('_', ' ')}: {', '.join(items)}")
    return _clip(out)


def summary(root: Path, doc: dict[str, Any], rc: int) -> str:
    """The report of ``doc`` (fsck's JSON document) for people."""
    repaired = doc.get("mode") == "repair"
    done = "repaired (recovery ran), then checked" if repaired else "checked; nothing written"
    lines = [f"kvstore fsck: {root}: {done}"]
    problems = 0
    if doc.get("registry") == "missing":
        present = doc.get("tenants_with_data", [])
        what = f"tenants with data and no registry: {', '.join(present)}" if present else "no tenant has data yet"
        lines.append(f"  no registry.json: {what}")
        problems += len(present)
    if isinstance(doc.get("index"), str):
        lines.append(f"  index: {doc['index']}")
        problems += 1
    if repaired:
        changes = _recovery_lines(doc.get("recovery", {}))
        lines.append("  recovery: nothing to do" if not changes else "  recovery:")
        lines += [f"    {line}" for line in changes]
    if "plan" in doc:
        todo = plan_lines(doc["plan"])
        lines.append("  at the next start: " + ("nothing to do" if not todo else "the daemon would"))
        lines += [f"    {line}" for line in todo]
        problems += sum(
            len(v) if isinstance(v, list) else 1 for k, v in doc["plan"].items() if k != "index_missing" and v
        )
    verify = doc.get("verify")
    if verify is not None:
        frames = f", {verify['frames_opened']} frames opened" if verify.get("frames_opened") else " (frames not opened)"
        lines.append(
            f"  scrubbed: {_n(verify['segments'], 'segment')}, {_n(verify['records'], 'record')},"
            f" {_size(verify['bytes_checked'])}{frames}"
        )
        errors = [f"{e['segment']} at offset {e['offset']}: {e['error']}" for e in verify.get("errors", [])]
        lines.append("  damaged records: " + ("none" if not errors else str(len(errors))))
        lines += [f"    {line}" for line in _clip(errors)]
        problems += len(errors)
    owned = doc.get("not_owned")
    if owned and owned["paths"]:
        uid = owned["owner_uid"]
        lines.append(
            f"  not owned by the directory's owner (uid {uid}), so the daemon may fail to write them"
            f" ({len(owned['paths'])}; chown -R {uid}: {root} gives them back):"
        )
        lines += [f"    {path}" for path in _clip(owned["paths"])]
        problems += 1
    if rc == 0:
        lines.append("clean (exit status 0)")
    else:
        found = f"{_n(problems, 'problem')} found" if problems else "something is wrong"
        lines.append(f"{found} (exit status {rc}); --json gives the full report")
    return "\n".join(lines)
