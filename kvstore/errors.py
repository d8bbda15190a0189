"""One exception tree for kvstore.

Every error knows a stable machine-readable code and whether retrying the
same request can help; what each transport answers for it (an HTTP status,
S3's error code, a NIXL result) is the transport's business
(kvstore/transport/statuses.py, s3/errors.py). Messages name what was wrong
and what was expected; they never carry secrets or tenant plaintext.
"""

from __future__ import annotations

from kvstore import __version__  # (kvstore/__init__.py imports nothing: no cycle)


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    code: str = "internal"
    retryable: bool = False


# -- bad input (4xx) ---------------------------------------------------------


class InvalidInput(KVStoreError):
    code = "invalid_input"


class InvalidKey(InvalidInput):
    code = "invalid_key"


class InvalidTenant(InvalidInput):
    code = "invalid_tenant"


class InvalidRange(KVStoreError):
    """A byte range that does not overlap the block (RFC 9110 §15.5.17)."""

    code = "range_not_satisfiable"

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class BlockTooLarge(KVStoreError):
    code = "block_too_large"


class NotFound(KVStoreError):
    code = "not_found"


class TenantNotFound(NotFound):
    code = "tenant_not_found"


class TenantExists(KVStoreError):
    code = "tenant_exists"


class NotAdmitted(KVStoreError):
    """Not a failure: a put the tenant's admission declined (``admit_after``:
    the block is stored only at its N-th offer within ``admit_window_s``;
    engine/admission.py). Nothing was stored, and retrying at once would
    only count another offer. Raised rather than returned so that a
    transport that does not know it answers it as the route does (HTTP
    ``202``, no ETag) instead of taking the block for stored."""

    code = "not_admitted"

    def __init__(self, key: str, offers: int, admit_after: int, window_s: int) -> None:
        super().__init__(
            f"block {key!r} not stored: offer {offers} of the {admit_after} its tenant's admit_after asks "
            f"within {window_s} s"
        )
        self.key = key
        self.offers = offers
        self.admit_after = admit_after

    def answer(self) -> dict[str, object]:
        """What a client is told (the body of ``PUT /v1/blocks/{key}``'s
        ``202``; a batch, write plan or NIXL item adds its ``status``)."""
        return {"key": self.key, "admitted": False, "offers": self.offers, "admit_after": self.admit_after}


# -- configuration and start-up ---------------------------------------------


class NotPlannable(KVStoreError):
    """A read plan cannot hand this block to the client (a sealed record, or
    one in the object tier only): read it with GET."""

    code = "not_plannable"


class UnixSocketRequired(KVStoreError):
    """Read plans pass file descriptors: only over a unix socket."""

    code = "unix_socket_required"


class PathsNotOffered(KVStoreError):
    """A read plan with paths was asked for, but the daemon does not give
    them (``plan_paths`` is off)."""

    code = "paths_not_offered"


class InsecureTransport(KVStoreError):
    """A record's own key is handed out only where no one else can read it:
    over TLS, a unix socket, or loopback."""

    code = "insecure_transport"


# -- NIXL transfers (/v1/xfer/*) ----------------------------------------------


class NixlDisabled(KVStoreError):
    """This daemon runs no NIXL agent (``nixl = false``): use HTTP. A 404
    (the transfer routes are not offered), not a 5xx: nothing failed."""

    code = "nixl_disabled"


class AgentUnknown(KVStoreError):
    """A transfer names a NIXL agent this daemon has not been introduced to
    (or that another tenant introduced): POST /v1/xfer/agents first."""

    code = "agent_unknown"


class AgentTaken(KVStoreError):
    """Another tenant registered a NIXL agent of this name."""

    code = "agent_taken"


class LeaseNotFound(NotFound):
    code = "lease_not_found"


class TransferFailed(KVStoreError):
    """A one-sided transfer between the daemon's agent and a client's failed
    or did not finish in time."""

    code = "transfer_failed"
    retryable = True


class ConfigError(KVStoreError):
    """A bad configuration value; the message names the key and the value."""

    code = "config_error"


class MasterKeyError(ConfigError):
    """The master key is missing, malformed, or does not match the store."""

    code = "master_key_error"


class StoreLocked(KVStoreError):
    code = "store_locked"


# -- the store's own state (5xx) ---------------------------------------------


class IndexUnusable(KVStoreError):
    """The LMDB index cannot be opened or has another format: rebuild it."""

    code = "index_unusable"


class StoreClosed(KVStoreError):
    code = "not_ready"
    retryable = True


class ReadOnlyStore(KVStoreError):
    """A write reached a process that opened the store for reads only."""

    code = "read_only"
    retryable = True


class StorageFull(KVStoreError):
    """No room: ENOSPC while writing a batch, or the data directory is at its
    capacity with nothing it may drop. Nothing of the write was acknowledged."""

    code = "storage_full"
    retryable = True


class ReadOnlyNode(KVStoreError):
    """A write reached a node that adopted a bucket read-only (``s3_readonly``)."""

    code = "read_only_node"


class Fenced(KVStoreError):
    """A fleet node that cannot prove it is alive (its heartbeat could not be
    written for a while, or the fleet holds it dead) refuses writes until it
    has rejoined, so a partitioned node never serves as if it were alone
    (kvstore/fleet/node.py)."""

    code = "fenced"
    retryable = True


class NodeAlive(KVStoreError):
    """An operator asked to forget (decommission) a fleet node the fleet holds alive."""

    code = "node_alive"


class FleetOff(KVStoreError):
    """``GET /v1/fleet`` on a node that is not in a fleet (``fleet`` is off)."""

    code = "fleet_off"


class FlushIncomplete(KVStoreError):
    """``POST /v1/admin/flush`` ran out of time before every sealed segment was
    in the object tier; the message says how many wait."""

    code = "flush_incomplete"
    retryable = True


class StorageIOError(KVStoreError):
    """An I/O error while writing or syncing a batch; the batch failed whole."""

    code = "io_error"
    retryable = True


class CorruptionError(KVStoreError):
    """Stored bytes failed an integrity check. Never returned as data."""

    code = "corruption"

    def __init__(self, message: str, segment: str = "", offset: int = -1) -> None:
        where = f" (segment {segment}, offset {offset})" if segment else ""
        super().__init__(message + where)
        self.segment = segment
        self.offset = offset


class FormatError(CorruptionError):
    """Bytes that do not parse as the on-disk format (bad magic, bad checksum)."""

    code = "format_error"


class UnknownFlags(FormatError):
    code = "unknown_flags"


class TenantKeyDestroyed(CorruptionError):
    """A record sealed under a key that no longer exists (crypto-shredded)."""

    code = "not_found"


class NewerFormat(KVStoreError):
    """Stored bytes (a segment, a record, the index, the tenant registry, a
    gateway record or catalog) carry a format version newer than this
    kvstore reads: a later release wrote them. Not corruption, so nothing
    that handles corruption (a torn tail cut, a record skipped or deleted)
    ever sees it: whatever meets it stops and changes nothing. The message
    names the version found, the versions this release reads, and the way
    on: upgrade, or restore what this release wrote (docs/operations.md)."""

    code = "newer_format"

    def __init__(
        self,
        what: str,
        found: object,
        reads: tuple[int, ...],
        restore: str = "the data directory",
        segment: str = "",
        offset: int = -1,
        also: str = "",
    ) -> None:
        where = f" (segment {segment}, offset {offset})" if segment and offset >= 0 else ""
        where = where or (f" ({segment})" if segment else "")
        shown = ", ".join(str(v) for v in reads)
        super().__init__(
            f"{what}{where} is in format version {found}, written by a newer kvstore; this kvstore "
            f"({__version__}) reads version{'s' if len(reads) > 1 else ''} {shown} only. Upgrade kvstore to "
            f"the release that wrote it (or a later one), or restore {restore} from a backup this release "
            f"wrote{also}; nothing was changed (docs/operations.md)"
        )
        self._args = (what, found, reads, restore, segment, offset, also)

    @staticmethod
    def is_newer(found: object, reads: tuple[int, ...]) -> bool:
        """Whether a stored version (any JSON or struct value) is one a later
        release wrote: an integer above every version this release reads."""
        return isinstance(found, int) and not isinstance(found, bool) and found > max(reads)

    def __reduce__(self) -> tuple[type[NewerFormat], tuple[object, ...]]:
        return (type(self), self._args)  # pickled whole (the default would pass the message alone)


# -- HTTP-level errors ---------------------------------------------------------


class Misdirected(KVStoreError):
    """A write of a key this fleet node does not own: the fleet's placement
    (rendezvous hashing over the alive members, the client library's own
    function) puts it on ``owner``, where the fleet looks for it. Refused,
    never stored here (HTTP 421, the owner's URL in ``Kvstore-Owner``); the
    fleet client reads the membership again and sends it there."""

    code = "misdirected"

    def __init__(self, message: str, owner: str) -> None:
        super().__init__(message)
        self.owner = owner


class Unauthorized(KVStoreError):
    """No bearer token, or one that names no tenant (or no admin)."""

    code = "unauthorized"


class LengthRequired(KVStoreError):
    code = "length_required"


class RequestTimeout(KVStoreError):
    code = "request_timeout"
    retryable = True


class Overloaded(KVStoreError):
    code = "overloaded"
    retryable = True


class RateLimited(Overloaded):
    """A tenant over one of its QoS limits (kvstore/qos/): retry after
    ``retry_after`` seconds (HTTP 429 and ``Retry-After``; S3's ``SlowDown``)."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ExpectationFailed(KVStoreError):
    """An ``Expect`` header other than ``100-continue`` (RFC 9110 §10.1.1)."""

    code = "expectation_failed"


class WriterTimeout(KVStoreError):
    """A reader worker relayed a request to the writer worker, which did not
    answer in time; the writer may still complete it."""

    code = "timeout"
    retryable = True


class BodyTooLarge(KVStoreError):
    """A request body (other than a block) over its limit, e.g. a JSON body over 4 MiB."""

    code = "body_too_large"


class UnsupportedMediaType(KVStoreError):
    """A request body in an encoding the route does not accept (a JSON body
    in a charset other than UTF-8)."""

    code = "unsupported_media_type"


# -- batch framing -------------------------------------------------------------


class BadFraming(InvalidInput):
    """A batch stream (``application/x-kvstore-batch``, see kvstore/transport/batchframe.py)
    that breaks the framing; the message names the item, the byte offset and what
    was wrong."""

    code = "bad_framing"


# -- the object-storage tier (G4) ----------------------------------------------


class TierError(KVStoreError):
    """An object-storage tier (kvstore/tier/) failed in a way retrying will not fix:
    denied access, a missing bucket, a bad request. Each backend maps its own
    errors into this branch in one place."""

    code = "tier_error"


class TierUnavailable(TierError):
    """The tier cannot be reached now: connection refused or reset, timeouts,
    5xx answers, throttling. Retrying later can succeed."""

    code = "tier_unavailable"
    retryable = True


class TierNotFound(TierError):
    """The object does not exist in the tier."""

    code = "tier_not_found"


class TierMisconfigured(TierError):
    """The tier refuses this node for a reason of its configuration, which
    no retry will change: the bucket does not exist, access is denied, no
    credentials were found. At start-up it is a configuration error (one
    line, exit 2), on a single node as on a fleet node."""


class BucketNotFound(TierMisconfigured):
    """The tier's bucket does not exist (S3's ``NoSuchBucket``): no object
    can be in it, and none can be written. Not an absent object: a read
    that finds no bucket raises this, never answers "no such object"."""


class TierAccessDenied(TierMisconfigured):
    """The tier refused the node's credentials or their rights (S3's
    ``AccessDenied``, ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, an
    expired token: a 401 or 403)."""


class TierNoCredentials(TierMisconfigured):
    """No credentials were found to sign the tier's requests with (boto3's
    chain: the environment, a profile, an instance or container role)."""


class TierConflict(TierError):
    """A conditional write lost: the object changed (or appeared, or went)
    since the etag the writer read (S3's 412 Precondition Failed). Read it
    again and redo the change."""

    code = "tier_conflict"


class TierRangeError(TierError):
    """A ranged read past the end of the object; ``size`` is its size (-1 if unknown)."""

    code = "tier_range"

    def __init__(self, message: str, size: int = -1) -> None:
        super().__init__(message)
        self.size = size


class InvalidObjectName(TierError):
    """An object name or prefix outside ``[A-Za-z0-9._/-]``, with an empty, ``.`` or
    ``..`` path segment, or a leading ``/``."""

    code = "invalid_object_name"


# -- the segment lifecycle ---------------------------------------------------------


class SegmentMoved(KVStoreError):
    """A read found its segment gone because the block moved (compaction) or
    went (eviction) meanwhile; the store retries with the index's new answer.
    Reaching a client, it is retryable."""

    code = "retry"
    retryable = True


class KeyReserved(KVStoreError):
    """Maintenance met a key a write plan holds space for (write_plan.py):
    what it would write for that key must wait until the plan ends."""

    code = "key_reserved"
    retryable = True


class WritePlanNotFound(NotFound):
    code = "write_plan_not_found"


class WrittenBytesMismatch(KVStoreError):
    """A write plan's commit: the bytes in the reserved space do not match
    the checksums the client gave (not written, or written wrong)."""

    code = "checksum_mismatch"


class RecordRejected(KVStoreError):
    """A record a client sealed itself does not open under the key and the
    binding its plan gave (forged, truncated, replayed or misbound)."""

    code = "record_rejected"


class QuotaExceeded(KVStoreError):
    """A single block larger than its tenant's whole quota (``quota_bytes``)."""

    code = "quota_exceeded"
