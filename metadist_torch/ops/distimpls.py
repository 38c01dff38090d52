"""The distributed implementations torch lowers: the core's records with torch's hooks attached, made once."""

from __future__ import annotations

import functools

from metadist_core.discovery.distimpl import DistImplRegistry

from . import ep_dispatch
from .cp_attention import FRONTEND, register_torch


@functools.lru_cache(maxsize=1)
def torch_impls() -> tuple[DistImplRegistry, str]:
    """The registry of the implementations torch runs (hooks ``simulate`` and ``lower``), and torch's name there."""
    registry = DistImplRegistry()
    register_torch(registry)
    ep_dispatch.register_torch(registry)
    return registry, FRONTEND


__all__ = ["torch_impls"]
