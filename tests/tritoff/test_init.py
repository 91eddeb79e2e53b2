"""tritoff/__init__.py: the public names, loaded lazily."""

import tritoff


def test_every_public_name_resolves():
    """``tritoff.__all__`` loads its names lazily: each must exist where it is looked up (``from tritoff import *``
    fails on the first that does not)."""
    for name in tritoff.__all__:
        assert getattr(tritoff, name) is not None, name
    namespace: dict = {}
    exec("from tritoff import *", namespace)
    assert set(tritoff.__all__) <= set(namespace)
