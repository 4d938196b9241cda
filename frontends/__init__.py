"""Frontends of asyncengine: the WebSocket protocol and server, the asyncio client, the CLI and
the terminal dashboard. They depend on `asyncengine`, never the reverse."""
