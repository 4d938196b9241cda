"""URLs of a listening server: IPv4, IPv6 literals in brackets, and the scheme per front end."""

from __future__ import annotations

import pytest

from frontends.listening import ListeningAddress


class _Server(ListeningAddress):
    scheme = "ws"


def test_urls_follow_the_address_and_scheme() -> None:
    server = _Server()
    server._address = ("127.0.0.1", 8765)
    assert (server.host, server.port) == ("127.0.0.1", 8765)
    assert server.url == "ws://127.0.0.1:8765"
    assert server.url_for("http") == "http://127.0.0.1:8765"
    server._address = ("::1", 8000)
    assert server.url == "ws://[::1]:8000"


def test_unstarted_server_has_no_address() -> None:
    with pytest.raises(AssertionError, match="not started"):
        _ = _Server().port
