"""S3's rules for bucket names, which the catalog and the records keep
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html):
3-63 characters of a-z 0-9 . -, starting and ending with a letter or digit,
no ``..``, ``.-`` or ``-.``, not an IPv4 address, not ``xn--`` (punycode)."""

from __future__ import annotations

import re

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+")


def valid_bucket_name(name: str) -> bool:
    """Whether ``name`` is a bucket name S3 accepts."""
    return not (
        _BUCKET_RE.fullmatch(name) is None
        or ".." in name
        or ".-" in name
        or "-." in name
        or _IPV4_RE.fullmatch(name) is not None
        or name.startswith("xn--")
    )
