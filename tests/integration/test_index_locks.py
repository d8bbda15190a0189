"""The index shares LMDB's lock file with the other processes of a node.

LMDB's claim on ``lock.mdb`` is a POSIX record lock, which closing any
descriptor of the file drops for the whole process. When the writer lost it
(the reader table was given disk space through a descriptor opened and
closed after the environment was open), the next worker to open the index
took itself for the only user and initialised the lock file again under the
running writer: its readers vanished from the table and a later commit,
built on a stale transaction id, corrupted the free list for good (the model
stress test's ``mdb_page_touch`` assertion, in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.engine.index import Index

_OTHER_WORKER = """
import sys
from pathlib import Path
from kvstore.engine.index import Index
index = Index(Path(sys.argv[1]), readonly=True)
print(index.env.readers())
index.close()
"""


@pytest.mark.parametrize("existing", [False, True], ids=["new index", "existing index"])
def test_a_second_process_sees_the_writers_readers(tmp_path: Path, existing: bool) -> None:
    where = tmp_path / "index"
    if existing:
        Index(where).close()
    index = Index(where)
    try:
        with index.env.begin():  # a read the writer holds while another worker starts
            seen = subprocess.run(
                [sys.executable, "-c", _OTHER_WORKER, str(where)],
                cwd=Path(__file__).parents[2],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        slots = [line.split() for line in seen.splitlines()[1:] if line.strip()]
        assert [str(os.getpid())] in [s[:1] for s in slots], f"the writer's read is gone from the table:\n{seen}"
        # And the writer still writes on top of its last commit, not a reset one.
        index.bump_epoch()
        assert index.epoch() == 1
    finally:
        index.close()
