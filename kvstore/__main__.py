"""``python -m kvstore`` is the ``kvstore`` command."""

import sys

from kvstore.cli import main

sys.exit(main())
