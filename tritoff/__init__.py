"""tritoff: fp8 weight packs streamed to the GPU through fused Triton upcast kernels.

Importing tritoff is cheap: torch and the kernels load on first use of a name below.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "StorageFormat": "tritoff.formats",
    "get_format": "tritoff.formats",
    "Pack": "tritoff.packer",
    "PackLayout": "tritoff.pack",
    "HostArena": "tritoff.arena",
    "PackedModel": "tritoff.packer",
    "pack_model": "tritoff.packer",
    "SkipRules": "tritoff.skip",
    "snr_db": "tritoff.snr",
    "enable": "tritoff.engine",
    "disable": "tritoff.engine",
    "Engine": "tritoff.engine",
    "load_pipeline": "tritoff.loading",
    "BudgetError": "tritoff.planner",
    "plan": "tritoff.preview",
    "verify_store": "tritoff.store",
    "StoreError": "tritoff.store",
    "Preview": "tritoff.preview",
    "TritoffWarning": "tritoff.warn",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tritoff' has no attribute {name!r}")
