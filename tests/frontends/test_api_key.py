"""The servers' API key: who is admitted, whatever form the token arrives in."""

from __future__ import annotations

from frontends.api_key import ApiKey


def test_no_key_admits_everyone() -> None:
    key = ApiKey(None)
    assert not key.required
    assert key.admits(b"") and key.admits("anything")


def test_a_key_admits_only_itself_as_bytes_or_text() -> None:
    key = ApiKey("s3cret-é")
    assert key.required
    assert key.admits("s3cret-é") and key.admits("s3cret-é".encode())
    assert not key.admits("") and not key.admits(b"s3cret") and not key.admits("S3CRET-é")


def test_undecodable_text_is_refused_not_raised() -> None:
    # A query string can carry lone surrogates after percent-decoding with errors kept.
    assert not ApiKey("k").admits("\udcff")
