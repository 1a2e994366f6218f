"""``engine-options`` sets ``CacheConfig.sliding_window`` as vLLM's own engine does.

speculators builds its ``CacheConfig`` by hand without ``sliding_window``, so an all-sliding model
(Mistral-style window, no ``layer_types``) ran full attention in the generator (arch cells: 0.66
relative error on a 256-token window). The patch derives the value from the model config; here it
must equal what the installed ``EngineArgs.create_engine_config`` puts on the engine's own
``CacheConfig`` — for an all-sliding model (a window), an interleaved one (none: per-layer windows)
and one without a window.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.contract

vllm = pytest.importorskip("vllm")

from speculators_compat.patches.engine_options import engine_sliding_window  # noqa: E402
from speculators_compat_testbed import build_tiny_model  # noqa: E402
from speculators_compat_testbed.tiny_models import MISTRAL_SLIDING_WINDOW  # noqa: E402


def _engine_and_ours(model: str):
    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    engine = EngineArgs(model=model, max_model_len=2048, enforce_eager=True).create_engine_config()
    ours = engine_sliding_window(ModelConfig(model=model, max_model_len=2048, enforce_eager=True))
    return engine.cache_config.sliding_window, ours


@pytest.mark.parametrize("arch, want", [("mistral", MISTRAL_SLIDING_WINDOW), ("gemma3", None), ("llama", None)])
def test_the_window_is_the_engines_own(arch, want, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    engine, ours = _engine_and_ours(str(build_tiny_model(arch)))
    assert engine == want
    assert ours == engine


# Configs on which vLLM's two rules disagree: up to 0.26 "not interleaved" gives a window to a
# model whose layer_types are all full_attention (one type), from 0.29 "all sliding" gives none;
# explicit all-sliding layer_types get the window under both.
RULE_CASES = {
    "all-full-layer-types": {"layer_types": ["full_attention"] * 4},
    "all-sliding-layer-types": {"layer_types": ["sliding_attention"] * 4},
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_the_window_follows_the_installed_rule(case, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_model("mistral", overrides=RULE_CASES[case])
    engine, ours = _engine_and_ours(str(model))
    assert ours == engine, f"{case}: engine {engine}, patch {ours}"
    from vllm.engine.arg_utils import EngineArgs

    from speculators_compat.patches.engine_options import sliding_window_rule

    rule = sliding_window_rule(EngineArgs.create_engine_config)
    if case == "all-sliding-layer-types" or rule == "not-interleaved":
        assert engine == MISTRAL_SLIDING_WINDOW, (case, rule)  # one layer type: "not interleaved"
    else:
        assert engine is None, (case, rule)  # all full attention is not "all sliding"


def test_an_unknown_rule_fails_the_probe(monkeypatch):
    """A create_engine_config with neither rule's marker: the probe says what it expected."""
    from vllm.engine.arg_utils import EngineArgs

    from speculators_compat.patches import engine_options

    def create_engine_config(self):
        return self.model

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)
    assert engine_options.sliding_window_rule(EngineArgs.create_engine_config) is None
    problem = engine_options._probe(None)
    assert problem and "sliding_window" in problem and "is_interleaved" in problem
    with pytest.raises(RuntimeError, match="sliding-window rule"):
        engine_options.engine_sliding_window(types.SimpleNamespace(hf_text_config=None))


def test_the_generators_config_carries_the_window(monkeypatch):
    """The patched VllmConfig in speculators' module namespace (what _create_vllm_config calls)."""
    import speculators_compat

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    speculators_compat.activate()
    from speculators.data_generation import vllm_hidden_states_generator as gen

    model = str(build_tiny_model("mistral"))
    config = gen.VllmHiddenStatesGenerator._create_vllm_config(
        object.__new__(gen.VllmHiddenStatesGenerator), model, 2048, 0.5, 1
    )
    assert config.cache_config.sliding_window == MISTRAL_SLIDING_WINDOW
