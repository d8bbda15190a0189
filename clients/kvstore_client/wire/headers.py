"""HTTP header fields of kvstore's own that both sides read, named once."""

from __future__ import annotations

OWNER = "Kvstore-Owner"
"""On ``421 misdirected`` (a write to a fleet node that does not own the key):
the URL of the node that does, as the fleet's placement puts it."""

FLEET_VERSION = "Kvstore-Fleet-Version"
"""On a fleet client's writes: the version of the membership it placed the
key by. A node whose own view is older does not refuse the write as another
node's (its view may still list a node the fleet has declared dead)."""
