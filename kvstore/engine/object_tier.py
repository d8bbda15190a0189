"""The object tier the configuration names: S3 (``s3_bucket``), a directory
(``tier_dir``: NFS or other shared storage), or none."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.tier.base import Tier
from kvstore.tier.local import LocalTier
from kvstore.tier.s3 import S3Tier


def tier_from_config(config: StoreConfig) -> Tier | None:
    """An :class:`S3Tier` for ``s3_bucket`` (credentials from the standard AWS
    variables), or None: the daemon then runs G3 only. Path-style addressing
    is used when ``s3_addressing`` says so, or (``auto``) when an endpoint other
    than AWS's is given: most S3-compatible stores need it."""
    if config.tier_dir:
        return LocalTier(Path(config.tier_dir))
    if not config.s3_bucket:
        return None
    path_style = config.s3_addressing == "path" or (config.s3_addressing == "auto" and bool(config.s3_endpoint))
    return S3Tier(
        config.s3_bucket,
        config.s3_prefix,
        endpoint_url=config.s3_endpoint or None,
        region=config.s3_region or None,
        path_style=path_style,
        max_concurrency=max(16, 2 * config.s3_upload_concurrency),
        range_read_timeout=max(0.1, config.s3_read_timeout_ms / 1000),
    )
