"""testing.llama4_scaling's pure-python parts and the runner's --reference option (no torch)."""

from __future__ import annotations

import json
import math

import pytest

from speculators_compat_testbed import llama4_scaling as L

pytestmark = pytest.mark.unit

CFG = {"original_max_position_embeddings": 4, "beta": 0.25}


def test_factor_is_vllms_formula():
    # vLLM 0.16.0 / 0.32.0 _get_llama_4_scaling(4, 0.25, positions), measured in the test bed
    measured = {0: 1.0, 3: 1.0, 4: 1.1733, 7: 1.1733, 8: 1.2747, 16: 1.4024, 40: 1.5995,
                100: 1.8145, 300: 2.0827, 1000: 2.3814, 1200: 2.4268, 2046: 2.5596}
    for pos, want in measured.items():
        assert L.factor(pos, 4, 0.25) == pytest.approx(want, abs=1e-4)
    assert L.factor(10**6, 8192, 0.1) == pytest.approx(1 + 0.1 * math.log(1 + 10**6 // 8192))


def test_stats_counts_tokens_at_or_beyond_n():
    s = L.stats([40, 7, 300, 17, 1200, 33], CFG)
    assert s["tokens"] == 1597
    assert s["tokens_scaled"] == 1597 - 6 * 4
    assert s["min_factor"] == 1.0
    assert s["max_factor"] == pytest.approx(L.factor(1199, 4, 0.25))
    short = L.stats([3, 2], CFG)
    assert short["tokens_scaled"] == 0 and short["fraction_scaled"] == 0.0
    off = L.stats([100], {"original_max_position_embeddings": 4, "beta": 0.0})
    assert off["tokens_scaled"] == 0


def test_config_value(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert L.config_value(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"llama_4_scaling": dict(CFG, extra=1)}))
    assert L.config_value(tmp_path) == CFG
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"llama_4_scaling": CFG}}))
    assert L.config_value(tmp_path) == CFG
    (tmp_path / "config.json").write_text(json.dumps({"llama_4_scaling": {"beta": 0.1}}))
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        L.config_value(tmp_path)


def test_runner_reference_option():
    from speculators_compat_testbed import e2e_runner

    parser = e2e_runner.build_parser()
    assert parser.parse_args([]).reference == "hf"
    assert parser.parse_args(["--reference", "vllm"]).reference == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reference", "other"])
