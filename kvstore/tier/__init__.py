"""The object tier (G4), and local space (G3) around it.

``base.py`` is the protocol every backend implements (:class:`Tier`) and the
object-name rules; ``local.py`` is a directory (tests, NFS-style shared
storage); ``s3.py`` is any S3-compatible endpoint through boto3. One conformance
suite, tests/conformance/test_tier.py, runs over all of them. ``layout.py``
names the objects; ``mirror.py`` uploads sealed segments; ``remote.py`` reads
records and footers back; ``space.py`` measures local space and picks what to
drop; ``tiering.py`` runs them together for a store.
"""

from __future__ import annotations

from kvstore.tier.base import ObjectInfo, Tier, validate_object_name, validate_prefix
from kvstore.tier.local import LocalTier

__all__ = ["LocalTier", "ObjectInfo", "Tier", "validate_object_name", "validate_prefix"]
