"""The object tier the configuration names: S3 (``s3_bucket``), a directory
(``tier_dir``: NFS or other shared storage), or none."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.errors import BucketNotFound, ConfigError, TierMisconfigured, TierNoCredentials
from kvstore.tier.base import Tier
from kvstore.tier.local import LocalTier
from kvstore.tier.s3 import S3Tier


def node_prefix(node_id: str) -> str:
    """Where a fleet node's own objects live, under the fleet's prefix."""
    return f"nodes/{node_id}"


def tier_from_config(config: StoreConfig, *, node: str | None = None, fleet: bool = False) -> Tier | None:
    """An :class:`S3Tier` for ``s3_bucket`` (credentials from the standard AWS
    variables), or None: the daemon then runs G3 only. Path-style addressing
    is used when ``s3_addressing`` says so, or (``auto``) when an endpoint other
    than AWS's is given: most S3-compatible stores need it.

    With ``fleet`` set in the configuration, the tier is the node's own part
    of the bucket (``PREFIX/nodes/NODE_ID``), or another node's (``node``),
    or with ``fleet=True`` the fleet's whole prefix (kvstore/fleet/)."""
    sub = ""
    if config.fleet and not fleet:
        node = node or config.node_id
        if not node:
            raise ValueError("a fleet node's tier needs its node_id (kvstore/fleet/identity.py resolves it)")
        sub = node_prefix(node)
    if config.tier_dir:
        return LocalTier(Path(config.tier_dir) / sub if sub else Path(config.tier_dir))
    if not config.s3_bucket:
        return None
    path_style = config.s3_addressing == "path" or (config.s3_addressing == "auto" and bool(config.s3_endpoint))
    return S3Tier(
        config.s3_bucket,
        "/".join(p for p in (config.s3_prefix.strip("/"), sub) if p),
        endpoint_url=config.s3_endpoint or None,
        region=config.s3_region or None,
        path_style=path_style,
        max_concurrency=max(16, 2 * config.s3_upload_concurrency),
        range_read_timeout=max(0.1, config.s3_read_timeout_ms / 1000),
        # The fleet's small objects (heartbeats, membership, registry): a call
        # that cannot reach the bucket fails within about a heartbeat, so a
        # node's loop sees it in time (kvstore/fleet/node.py).
        max_attempts=2 if fleet else 5,
        connect_timeout=1.0 if fleet else 5.0,
        read_timeout=max(1.0, 2 * config.fleet_heartbeat_s) if fleet else 30.0,
    )


def refusal(config: StoreConfig, tier: Tier, e: TierMisconfigured) -> ConfigError:
    """What start-up says, in one line, of a tier that refuses this node
    (no bucket, access denied, no credentials): the setting or the
    credentials' source to look at, never a secret."""
    if not isinstance(tier, S3Tier):
        return ConfigError(f"tier_dir={config.tier_dir!r}: {e}")
    bucket = f"s3_bucket={config.s3_bucket!r}"
    where = f"at s3_endpoint={config.s3_endpoint!r}" if config.s3_endpoint else "on AWS S3 (no s3_endpoint)"
    if isinstance(e, BucketNotFound):
        who = "a fleet's nodes do not create their bucket: create it, then start them"
        if not config.fleet:
            who = "kvstore does not create its bucket: create it (or correct s3_bucket), then start"
        return ConfigError(f"{bucket}: no such bucket {where}; {who}")
    if isinstance(e, TierNoCredentials):
        return ConfigError(
            f"{bucket} {where}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE, or give the host a role)"
        )
    return ConfigError(
        f"{bucket} {where}: access denied to {tier.credential_source()} ({e}); kvstore needs to list, read, "
        "write and delete objects under s3_prefix"
    )
