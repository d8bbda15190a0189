"""HTTP header fields of kvstore's own that both sides read, named once."""

from __future__ import annotations

OWNER = "Kvstore-Owner"
"""On ``421 misdirected`` (a write to a fleet node that does not own the key):
the URL of the node that does, as the fleet's placement puts it."""
