"""The patch families. Each module opens with what vLLM changed, since when, and how its
patches answer; version ranges live in compat_matrix.yaml (by patch id), not here."""

from __future__ import annotations

from . import (
    engine_config,
    engine_options,
    execution,
    executor,
    kv_cache,
    kv_cache_hybrid,
    platform,
    scheduler_request,
    speculators_import,
    speculators_script,
    train_data,
    worker_capture,
    worker_errors,
)

FAMILY_MODULES = (
    speculators_import,
    engine_config,
    engine_options,
    platform,
    kv_cache,
    kv_cache_hybrid,
    scheduler_request,
    execution,
    executor,
    worker_capture,
    worker_errors,
    speculators_script,
    train_data,
)


def all_patches():
    """The Patch objects of every family (stateless: a registry keeps all state)."""
    out = []
    for module in FAMILY_MODULES:
        out.extend(module.PATCHES)
    return out
