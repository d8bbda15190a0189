"""The HTTP API's routes, one module per group; each exports ``routes`` (and
the start-up/shutdown contexts it needs), assembled by ``transport.http.app``."""
