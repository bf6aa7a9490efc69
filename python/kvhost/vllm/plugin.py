"""kvhost as a vLLM general plugin: registers KvhostOffloadingSpec with vLLM's
OffloadingSpecFactory, so ``"spec_name": "KvhostOffloadingSpec"`` works
without ``spec_module_path``.

Installed by ``pip install './python[vllm]'`` as the entry point ``kvhost``
of vLLM's group ``vllm.general_plugins`` (vllm/plugins/__init__.py
load_general_plugins runs it in every vLLM process; ``VLLM_PLUGINS`` may
name the plugins to load). vLLM 0.33's OffloadingSpecFactory.register_spec
(vllm/v1/kv_offload/factory.py) refuses a name twice, so a second call is a
no-op; the factory imports kvhost.vllm only when the spec is asked for.
"""

from __future__ import annotations

#: The spec's name in vLLM's factory.
SPEC_NAME = "KvhostOffloadingSpec"


def register() -> None:
    """Registers the spec by name (vLLM's plugin loader calls this)."""
    # Imported here, in vLLM's process: importing the plugin module costs nothing.
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: PLC0415

    if SPEC_NAME not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(SPEC_NAME, "kvhost.vllm.spec", SPEC_NAME)
