"""What can go wrong with an admin command, and the exit status each gives.

Every failure is one line on stderr (``kvstore admin: ...``) naming what
was wrong, and one of these statuses, which the command's help and
docs/operations.md list:

- :data:`OK` (0): done (and, with ``--wait``, in force on every alive node);
- :data:`REFUSED` (1): the daemon answered with an error (its code and
  message are shown; a 401 says the admin token was refused), or reported
  a failure in a successful answer (compaction errors);
- :data:`USAGE` (2): a flag, an argument or the URL or token is wrong or
  missing; nothing was sent;
- :data:`UNREACHABLE` (3): the daemon could not be reached (the URL is
  named), or its answer was cut off or not the API's;
- :data:`NOT_EVERYWHERE` (4): ``--wait`` ran out of time before every alive
  node held the change (the nodes behind are named); the change itself was
  made;
- :data:`DAMAGED` (5): ``verify`` found damage.
"""

from __future__ import annotations

OK = 0
REFUSED = 1
USAGE = 2
UNREACHABLE = 3
NOT_EVERYWHERE = 4
DAMAGED = 5


class AdminError(Exception):
    """A failure of the command: its one-line message and its exit status."""

    status = REFUSED


class UsageError(AdminError):
    status = USAGE


class Refused(AdminError):
    """The daemon answered with an error: ``http_status`` and its ``code``."""

    status = REFUSED

    def __init__(self, message: str, http_status: int, code: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code


class Unreachable(AdminError):
    status = UNREACHABLE


class NotEverywhere(AdminError):
    status = NOT_EVERYWHERE


class Damaged(AdminError):
    status = DAMAGED
