def test_import():
    import frontends.dashboard  # noqa: F401
