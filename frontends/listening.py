"""The address a started server listens on, and its URLs: shared by every front end."""

from __future__ import annotations


class ListeningAddress:
    """Mixin for a server that records `(host, port)` in `_address` once it listens."""

    scheme = "http"
    _address: tuple[str, int] | None = None

    @property
    def port(self) -> int:
        assert self._address is not None, "server not started"
        return int(self._address[1])

    @property
    def host(self) -> str:
        assert self._address is not None, "server not started"
        return str(self._address[0])

    def url_for(self, scheme: str) -> str:
        host = self.host
        # An IPv6 literal needs brackets in a URL.
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def url(self) -> str:
        return self.url_for(self.scheme)
