"""kvstore daemon, from a checkout: the same as ``kvstore serve`` (kvstore/daemon/).

    .venv/bin/python server.py --data-dir DIR --listen HOST:PORT [--config FILE]

Installed from the wheel, the command is ``kvstore serve``; this file stays for
the scripts and units that name it, and takes exactly the same flags and
environment.
"""

import sys

from kvstore.daemon import main

if __name__ == "__main__":
    sys.exit(main())
