"""Charts (``--png``): whether matplotlib is there, asked before a run that
would draw one, so that a missing plotting library fails the command at once
instead of after minutes of measuring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install matplotlib (or kvstore-server[bench])"


def matplotlib_missing() -> str | None:
    """None when matplotlib imports; else what is wrong and how to install it."""
    try:
        import matplotlib  # noqa: F401 - imported to see that it can be
    except ImportError as e:
        return f"needs matplotlib, which cannot be imported ({e}); install it: {INSTALL_HINT}"
    return None


def save_png(fig: Any, path: Path) -> None:
    """Write ``fig`` (a matplotlib figure) to ``path`` as a PNG, its folder
    made if need be, and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
