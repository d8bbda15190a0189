"""AWS Signature Version 4, as S3 checks it: the server's side.

What a client signed is rebuilt from the request as received and compared in
constant time with the signature it sent (AWS's "Signature Version 4 signing
process" and "Authenticating requests: using query parameters" and "using
the Authorization header", and S3's streaming ``aws-chunked`` uploads):

- the canonical request: method, the path URI-encoded once (S3 does not
  normalise it), the query sorted by encoded name and value, the signed
  headers (lowercase names, values trimmed and inner runs of spaces
  collapsed, several values of one name joined by commas), their names, and
  the payload's hash (``x-amz-content-sha256``; ``UNSIGNED-PAYLOAD`` for
  presigned URLs);
- the string to sign, the key derived from the secret, date, region and
  service, and the HMAC;
- the credential's scope (date, the gateway's region, ``s3``,
  ``aws4_request``), the request's time within :data:`MAX_SKEW_S` of the
  server's, and a presigned URL's expiry.

Pure functions and small classes, no I/O: the gateway passes the request's
parts in (:class:`RequestParts`) and gets an :class:`S3Error` or the parsed
authorization back.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import quote, unquote

from kvstore.transport.s3.errors import S3Error

ALGORITHM = "AWS4-HMAC-SHA256"
SERVICE = "s3"
TERMINATOR = "aws4_request"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_SIGNED = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
STREAMING_SIGNED_TRAILER = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
STREAMING_UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
STREAMING = frozenset({STREAMING_SIGNED, STREAMING_SIGNED_TRAILER, STREAMING_UNSIGNED_TRAILER})
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
MAX_SKEW_S = 15 * 60  # S3's window between the request's time and the server's
MAX_PRESIGNED_EXPIRES_S = 7 * 24 * 3600  # X-Amz-Expires: 1 s to 7 days, as S3

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_AMZ_DATE = re.compile(r"\d{8}T\d{6}Z")
_AUTH_PARAM = re.compile(r"\s*([A-Za-z]+)=([^,]*)\s*(?:,|$)")


@dataclass(frozen=True, slots=True)
class RequestParts:
    """What SigV4 covers, as the request arrived."""

    method: str
    raw_path: str  # percent-encoded, without the query
    raw_query: str  # percent-encoded, without the "?"
    headers: Mapping[str, Sequence[str]]  # lowercase name -> every value, in order


@dataclass(frozen=True, slots=True)
class Authorization:
    """A request's SigV4 authorization, parsed and checked for form."""

    access_key_id: str
    date: str  # YYYYMMDD, the credential's scope
    region: str
    amz_date: str  # YYYYMMDDTHHMMSSZ
    signed_headers: tuple[str, ...]
    signature: str
    payload_hash: str  # x-amz-content-sha256, or UNSIGNED-PAYLOAD
    presigned: bool
    expires_s: int = 0  # presigned only

    @property
    def scope(self) -> str:
        return f"{self.date}/{self.region}/{SERVICE}/{TERMINATOR}"


def _first(headers: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = headers.get(name)
    return values[0] if values else None


def parse_query(raw_query: str) -> list[tuple[str, str]]:
    """The query's (name, value) pairs, percent-decoded ("+" stays "+")."""
    out = []
    for part in raw_query.split("&"):
        if not part:
            continue
        name, _, value = part.partition("=")
        out.append((unquote(name), unquote(value)))
    return out


def parse_authorization(parts: RequestParts) -> Authorization | None:
    """The request's authorization: from the Authorization header or the
    presigned query; None for an anonymous request. Raises S3Error for one
    that is there but malformed."""
    header = _first(parts.headers, "authorization")
    query = dict(parse_query(parts.raw_query))
    if header is not None:
        return _from_header(header, parts)
    if "X-Amz-Signature" in query or "X-Amz-Algorithm" in query or "X-Amz-Credential" in query:
        return _from_query(query, parts)
    if "Signature" in query or "AWSAccessKeyId" in query:
        raise S3Error("AccessDenied", "Signature Version 2 is not supported; sign requests with SigV4")
    return None


def _credential(text: str, where: str) -> tuple[str, str, str]:
    """(access key id, date, region) of ``AKID/date/region/s3/aws4_request``."""
    fields = text.split("/")
    if len(fields) != 5 or not fields[0]:
        raise S3Error(
            "AuthorizationHeaderMalformed" if where == "header" else "AuthorizationQueryParametersError",
            f"the Credential {text[:128]!r} is malformed; expecting '<access key id>/YYYYMMDD/REGION/s3/aws4_request'",
        )
    akid, date, region, service, terminator = fields
    if service != SERVICE or terminator != TERMINATOR or not re.fullmatch(r"\d{8}", date):
        raise S3Error(
            "AuthorizationHeaderMalformed" if where == "header" else "AuthorizationQueryParametersError",
            f"the Credential's scope {'/'.join(fields[1:])!r} is malformed;"
            " expecting 'YYYYMMDD/REGION/s3/aws4_request'",
        )
    return akid, date, region


def _from_header(header: str, parts: RequestParts) -> Authorization:
    algorithm, _, rest = header.strip().partition(" ")
    if algorithm != ALGORITHM:
        if algorithm == "AWS":
            raise S3Error("AccessDenied", "Signature Version 2 is not supported; sign requests with SigV4")
        raise S3Error("AuthorizationHeaderMalformed", f"unsupported authorization type {algorithm[:32]!r}")
    params: dict[str, str] = {}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        m = _AUTH_PARAM.match(rest, pos)
        if m is None or m.end() == pos:
            raise S3Error("AuthorizationHeaderMalformed", "the Authorization header is malformed")
        params[m.group(1)] = m.group(2).strip()
        pos = m.end()
    missing = [p for p in ("Credential", "SignedHeaders", "Signature") if p not in params]
    if missing:
        raise S3Error("AuthorizationHeaderMalformed", f"the Authorization header lacks {', '.join(missing)}")
    akid, date, region = _credential(params["Credential"], "header")
    amz_date = _first(parts.headers, "x-amz-date") or ""
    if not _AMZ_DATE.fullmatch(amz_date):
        raise S3Error("AccessDenied", "AWS authentication requires a valid x-amz-date header (YYYYMMDDTHHMMSSZ)")
    payload = _first(parts.headers, "x-amz-content-sha256")
    if payload is None:
        raise S3Error("InvalidRequest", "Missing required header for this request: x-amz-content-sha256")
    if payload not in STREAMING and payload != UNSIGNED_PAYLOAD and not _SHA256_HEX.fullmatch(payload):
        raise S3Error("InvalidArgument", "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-… or a SHA-256 hex")
    signed = tuple(params["SignedHeaders"].split(";"))
    return Authorization(akid, date, region, amz_date, signed, params["Signature"], payload, presigned=False)


def _from_query(query: dict[str, str], parts: RequestParts) -> Authorization:
    needed = ("X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders")
    missing = [n for n in (*needed, "X-Amz-Signature") if n not in query]
    if missing:
        raise S3Error(
            "AuthorizationQueryParametersError",
            f"Query-string authentication version 4 requires the {', '.join(missing)} parameters",
        )
    if query["X-Amz-Algorithm"] != ALGORITHM:
        raise S3Error("AuthorizationQueryParametersError", 'X-Amz-Algorithm only supports "AWS4-HMAC-SHA256"')
    akid, date, region = _credential(query["X-Amz-Credential"], "query")
    amz_date = query["X-Amz-Date"]
    if not _AMZ_DATE.fullmatch(amz_date):
        raise S3Error(
            "AuthorizationQueryParametersError",
            "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\"",
        )
    expires = query["X-Amz-Expires"]
    if not expires.isdigit() or len(expires) > 10:
        raise S3Error("AuthorizationQueryParametersError", "X-Amz-Expires should be a number")
    if int(expires) > MAX_PRESIGNED_EXPIRES_S:
        raise S3Error(
            "AuthorizationQueryParametersError", "X-Amz-Expires must be less than a week (in seconds) that is 604800"
        )
    payload = _first(parts.headers, "x-amz-content-sha256") or UNSIGNED_PAYLOAD
    signed = tuple(query["X-Amz-SignedHeaders"].split(";"))
    return Authorization(
        akid, date, region, amz_date, signed, query["X-Amz-Signature"], payload, presigned=True, expires_s=int(expires)
    )


def amz_time(amz_date: str) -> int:
    """Unix seconds of a YYYYMMDDTHHMMSSZ timestamp."""
    return calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))


def check_scope_and_time(auth: Authorization, region: str, now: float | None = None) -> None:
    """The scope names this gateway's region and the request's own date; the
    request is within the skew window, or the presigned URL unexpired."""
    if auth.region != region:
        raise S3Error(
            "AuthorizationHeaderMalformed" if not auth.presigned else "AuthorizationQueryParametersError",
            f"the region '{auth.region[:64]}' is wrong; expecting '{region}'",
            region=region,
        )
    if auth.date != auth.amz_date[:8]:
        raise S3Error(
            "SignatureDoesNotMatch" if not auth.presigned else "AuthorizationQueryParametersError",
            "the date in the Credential scope does not match the request's date",
        )
    try:
        when = amz_time(auth.amz_date)
    except ValueError:
        raise S3Error("AccessDenied", "the request's date is not a valid date") from None
    now = time.time() if now is None else now
    if auth.presigned:
        if now < when - MAX_SKEW_S:
            raise S3Error("AccessDenied", "Request is not valid yet")
        if now > when + auth.expires_s:
            raise S3Error("AccessDenied", "Request has expired")
    elif abs(now - when) > MAX_SKEW_S:
        raise S3Error(
            "RequestTimeTooSkewed",
            "The difference between the request time and the current time is too large.",
        )


def uri_encode(text: str, slash: bool) -> str:
    """AWS's URI encoding: every byte but A-Z a-z 0-9 - _ . ~ as %XX
    (uppercase hex); "/" kept in paths (``slash``)."""
    return quote(text, safe="/~" if slash else "~")


def canonical_query(raw_query: str, presigned: bool) -> str:
    pairs = [
        (uri_encode(n, False), uri_encode(v, False))
        for n, v in parse_query(raw_query)
        if not (presigned and n == "X-Amz-Signature")
    ]
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


_SPACES = re.compile(r"\s+")


def canonical_headers(headers: Mapping[str, Sequence[str]], signed: Sequence[str]) -> str:
    lines = []
    for name in signed:
        values = headers.get(name, ())
        lines.append(f"{name}:{','.join(_SPACES.sub(' ', v.strip()) for v in values)}\n")
    return "".join(lines)


def canonical_request(parts: RequestParts, auth: Authorization) -> str:
    return "\n".join(
        (
            parts.method,
            uri_encode(unquote(parts.raw_path), True),
            canonical_query(parts.raw_query, auth.presigned),
            canonical_headers(parts.headers, auth.signed_headers),
            ";".join(auth.signed_headers),
            auth.payload_hash,
        )
    )


def string_to_sign(amz_date: str, scope: str, canonical: str) -> str:
    return f"{ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"


@lru_cache(maxsize=1024)
def signing_key(secret: str, date: str, region: str) -> bytes:
    key = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
    for part in (region, SERVICE, TERMINATOR):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def sign(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def verify(parts: RequestParts, auth: Authorization, secret: str) -> bytes:
    """Check the request's signature with ``secret``; the signing key on
    success (a streaming upload's chunks are signed with it)."""
    if "host" not in auth.signed_headers:
        raise S3Error("AccessDenied", "the host header must be signed")
    if not auth.presigned:
        unsigned = sorted(
            name
            for name in parts.headers
            if name.startswith("x-amz-") and name not in auth.signed_headers and name != "x-amz-content-sha256"
        )
        if unsigned:
            raise S3Error(
                "AccessDenied", f"There were headers present in the request which were not signed: {unsigned[0][:64]}"
            )
        if "x-amz-content-sha256" not in auth.signed_headers:
            raise S3Error("AccessDenied", "x-amz-content-sha256 must be signed")
    key = signing_key(secret, auth.date, auth.region)
    expected = sign(key, string_to_sign(auth.amz_date, auth.scope, canonical_request(parts, auth)))
    if not hmac.compare_digest(expected, auth.signature):
        raise S3Error(
            "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided. "
            "Check your key and signing method.",
        )
    return key


class ChunkSigner:
    """The chain of a streaming upload's chunk signatures: each chunk signs
    its data and the previous chunk's signature, the first the request's."""

    def __init__(self, key: bytes, auth: Authorization) -> None:
        self._key = key
        self._amz_date = auth.amz_date
        self._scope = auth.scope
        self._previous = auth.signature

    def check_chunk(self, data_sha256_hex: str, signature: str) -> None:
        text = "\n".join(
            ("AWS4-HMAC-SHA256-PAYLOAD", self._amz_date, self._scope, self._previous, EMPTY_SHA256, data_sha256_hex)
        )
        self._check(text, signature)

    def check_trailer(self, trailer: bytes, signature: str) -> None:
        text = "\n".join(
            (
                "AWS4-HMAC-SHA256-TRAILER",
                self._amz_date,
                self._scope,
                self._previous,
                hashlib.sha256(trailer).hexdigest(),
            )
        )
        self._check(text, signature)

    def _check(self, text: str, signature: str) -> None:
        expected = sign(self._key, text)
        if not hmac.compare_digest(expected, signature):
            raise S3Error(
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you provided (a chunk's signature)",
            )
        self._previous = signature
