"""Charts (``--png``): whether matplotlib is there, asked before a run that
would draw one, so that a missing plotting library fails the command at once
instead of after minutes of measuring."""

from __future__ import annotations

INSTALL_HINT = "pip install matplotlib (or kvstore-server[bench])"


def matplotlib_missing() -> str | None:
    """None when matplotlib imports; else what is wrong and how to install it."""
    try:
        import matplotlib  # noqa: F401 - imported to see that it can be
    except ImportError as e:
        return f"needs matplotlib, which cannot be imported ({e}); install it: {INSTALL_HINT}"
    return None
