"""Entry point of group ``vllm.general_plugins``: activates the shim in every vLLM process.

vLLM calls general plugins in the engine-core process and at the top of each worker's
``init_worker`` (before it resolves ``worker_extension_cls``), also under spawn. vLLM may call
them several times per process; activation is idempotent.
"""

from __future__ import annotations


def register() -> None:
    import speculators_compat

    speculators_compat.activate()
