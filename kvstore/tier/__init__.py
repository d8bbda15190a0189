"""The object tier's backends (G4): leaves that know objects, not segments.

``base.py`` is the protocol every backend implements (:class:`Tier`) and the
object-name rules; ``local.py`` is a directory (tests, NFS-style shared
storage); ``s3.py`` is any S3-compatible endpoint through boto3. One
conformance suite, tests/conformance/test_tier.py, runs over all of them.
Nothing here imports the engine: what goes into the tier, when, and where a
segment's data lives is the engine's residency (kvstore/engine/residency.py,
mirror.py, space.py, remote.py, layout.py, object_tier.py).
"""

from __future__ import annotations

from kvstore.tier.base import ObjectInfo, Tier, validate_object_name, validate_prefix
from kvstore.tier.local import LocalTier

__all__ = ["LocalTier", "ObjectInfo", "Tier", "validate_object_name", "validate_prefix"]
