"""The composition root: the daemon's command, its processes and its node.

- main.py: ``kvstore serve`` (argv, settings, secrets, checks), then one
  process or the supervisor;
- supervisor.py: the workers of a multi-worker daemon (one writer, readers);
- process.py: one process, serving its node on its listeners until SIGTERM;
- listeners.py: the sockets, bound once before anything opens;
- node.py: the node (the store, the admission and QoS, events, NIXL, the
  fleet), assembled and closed in one order; fleet.py: a fleet node's parts;
- app.py: the HTTP transport over the node.

The transports (kvstore/transport/) are adapters over the node; none of
them builds it, and none imports this package.
"""

from kvstore.daemon.main import main

__all__ = ["main"]
