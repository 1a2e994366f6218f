"""The rehearsal's shrink rules, each on the published configs in tests/data/released_configs and
on hand-made fields; plus the rehearsal's static checks (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators_compat_testbed import rehearsal, shrink

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "released_configs"
RELEASED = sorted(p.parent.name for p in CONFIGS.glob("*/config.json"))


def _cfg(**kw) -> dict:
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=32, hidden_size=4096,
                num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                bos_token_id=128000, eos_token_id=[128001, 128009])
    base.update(kw)
    return base


def test_released_configs_are_committed():
    assert {"llama-3.1-8b-instruct", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "mistral-7b-v0.1",
            "gpt-oss-20b"} <= set(RELEASED), RELEASED


@pytest.mark.parametrize("slug", RELEASED)
def test_shrink_keeps_the_architecture_of_each_released_config(slug):
    cfg = json.loads((CONFIGS / slug / "config.json").read_text())
    s = shrink.shrink(cfg, rehearsal.speculators_default_layers(shrink.text_config(cfg)["num_hidden_layers"]))
    before, after = shrink.text_config(cfg), s.text
    assert s.config["model_type"] == cfg["model_type"] and s.config.get("architectures") == cfg.get("architectures")
    for key in ("head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "rope_scaling", "rope_theta", "scoring_func", "topk_method", "num_experts_per_tok", "n_group",
                "topk_group", "n_shared_experts", "tie_word_embeddings", "hidden_act", "linear_key_head_dim"):
        assert after.get(key) == before.get(key), key
    if not before.get("head_dim") and not before.get("kv_lora_rank"):  # head size kept through hidden/heads
        assert after["hidden_size"] // after["num_attention_heads"] == before["hidden_size"] // before["num_attention_heads"]
    assert 4 <= after["num_hidden_layers"] <= 8 and after["num_hidden_layers"] < before["num_hidden_layers"]
    assert "quantization_config" not in after and "quantization_config" not in s.config
    kinds = shrink.layer_kinds(before)
    assert set(shrink.layer_kinds(after)) == set(kinds)  # every published attention kind still runs
    assert len(set(s.layer_map.values())) == len(s.layer_map)


def test_depth_covers_every_layer_kind_and_a_dense_and_moe_layer():
    gemma = _cfg(model_type="gemma3_text", num_hidden_layers=26, head_dim=256, sliding_window=512,
                 layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 20)
    assert shrink.shrunk_depth(gemma) == 6
    nxt = _cfg(num_hidden_layers=48, full_attention_interval=4)
    assert shrink.shrunk_depth(nxt) == 4 and shrink.layer_kinds(nxt)[3] == "full_attention"
    ds = _cfg(num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256)
    s = shrink.shrink(ds)
    assert s.text["first_k_dense_replace"] == 1 and s.text["num_hidden_layers"] == 4


def test_layer_ids_map_in_order_last_onto_last_and_bad_ids_are_refused():
    m = shrink.map_layer_ids([2, 30, 58, 60], 61, 4)
    assert list(m.values()) == sorted(set(m.values())) and m[60] == 3 and len(set(m.values())) == 4
    with pytest.raises(shrink.ShrinkError, match="layer id 61 is outside the model's 61 layers"):
        shrink.map_layer_ids([2, 61], 61, 4)


def test_attention_kinds_are_kept():
    gqa = shrink.shrink(_cfg()).text
    assert (gqa["num_attention_heads"], gqa["num_key_value_heads"], gqa["hidden_size"]) == (4, 2, 512)
    mqa = shrink.shrink(_cfg(num_key_value_heads=1, head_dim=256)).text
    assert (mqa["num_key_value_heads"], mqa["head_dim"], mqa["hidden_size"]) == (1, 256, shrink.HIDDEN)
    mla = shrink.shrink(_cfg(num_key_value_heads=128, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536)).text
    assert (mla["num_key_value_heads"], mla["kv_lora_rank"], mla["q_lora_rank"]) == (4, 512, 1536)


def test_experts_leave_group_limited_routing_enough_experts():
    s = shrink.shrink(_cfg(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                           moe_intermediate_size=2048)).text
    e = s["n_routed_experts"]
    assert e % 8 == 0 and 4 * (e // 8) >= 8 and e >= 16 and s["moe_intermediate_size"] == shrink.EXPERT_INTERMEDIATE
    oss = shrink.shrink(_cfg(num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, head_dim=64)).text
    assert oss["num_local_experts"] == 8 and oss["intermediate_size"] == shrink.EXPERT_INTERMEDIATE


def test_windows_fall_below_the_rehearsal_prompts():
    s = shrink.shrink(_cfg(sliding_window=4096, llama_4_scaling={"original_max_position_embeddings": 8192, "beta": 0.1}))
    assert s.text["sliding_window"] == shrink.WINDOW and s.text["llama_4_scaling"]["original_max_position_embeddings"] == 256
    off = shrink.shrink(_cfg(sliding_window=32768, use_sliding_window=False)).text
    assert off["sliding_window"] == 32768  # not used by the model: left alone


def test_vocab_and_special_ids_follow_the_stand_in_tokenizer():
    s = shrink.shrink(_cfg(image_token_id=151655, video_token_id=151656, pad_token_id=None))
    assert s.config["vocab_size"] == shrink.VOCAB and s.config["bos_token_id"] == 1 and s.config["eos_token_id"] == [2]
    assert {s.config["image_token_id"], s.config["video_token_id"]} == {shrink.VOCAB - 1, shrink.VOCAB - 2}
    kept = shrink.shrink(_cfg(), keep_vocab=True)
    assert kept.config["vocab_size"] == 128256 and kept.config["bos_token_id"] == 128000


def test_quantization_is_dropped_and_said():
    s = shrink.shrink(_cfg(quantization_config={"quant_method": "fp8"}))
    assert "quantization_config" not in s.config and any("fp8" in d for d in s.dropped)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(rehearsal.CannotRehearse, match="expected a model folder with config.json"):
        rehearsal.read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(rehearsal.CannotRehearse, match="not a readable JSON config"):
        rehearsal.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_cfg(num_hidden_layers="32")))
    with pytest.raises(rehearsal.CannotRehearse, match="num_hidden_layers"):
        rehearsal.plan(tmp_path, None, 1, None)
    (tmp_path / "config.json").write_text(json.dumps(_cfg(auto_map={"AutoConfig": "configuration_x.XConfig"})))
    with pytest.raises(rehearsal.CannotRehearse, match="remote code configuration_x.py, which the folder lacks"):
        rehearsal.plan(tmp_path, None, 1, None)
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    with pytest.raises(rehearsal.CannotRehearse, match="layer id 40 is outside"):
        rehearsal.plan(tmp_path, [2, 40], 1, None)


def test_call_site_names_the_innermost_library_frame():
    tb = ('Traceback (most recent call last):\n  File "/x/site-packages/speculators/data_generation/g.py", line 10, in generate\n'
          '  File "/x/site-packages/vllm/v1/worker/gpu_model_runner.py", line 99, in execute_model\n'
          '  File "/usr/lib/python3.12/functools.py", line 5, in wrapper\n')
    assert rehearsal._call_site(tb) == "vllm/v1/worker/gpu_model_runner.py:99 in execute_model"


def test_keep_never_deletes_a_folder_a_rehearsal_did_not_write(tmp_path):
    """``--keep DIR`` replaces DIR/model only when DIR holds a rehearsal's marker: a user's own
    model folder named ``model`` under DIR is refused, untouched."""
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    mine = tmp_path / "model"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"the user's weights")
    with pytest.raises(rehearsal.CannotRehearse, match="exists and was not written by a rehearsal"):
        rehearsal.rehearse(tmp_path, workdir=tmp_path)
    assert (mine / "model.safetensors").read_bytes() == b"the user's weights"


def test_tensor_parallel_size_must_be_positive(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    with pytest.raises(rehearsal.CannotRehearse, match="--tensor-parallel-size: expected a positive integer; found 0"):
        rehearsal.rehearse(tmp_path, tensor_parallel_size=0, workdir=tmp_path / "keep")


def test_cpu_tensor_parallel_ranks_get_disjoint_core_groups():
    """TP on a CPU: one consecutive group of this process's cores per rank (CPU vLLM's "auto"
    binding wants one NUMA node per rank)."""
    assert rehearsal.cpu_bind([0, 1], 2) == "0|1"
    assert rehearsal.cpu_bind(list(range(8)), 2) == "0-3|4-7"
    assert rehearsal.cpu_bind([0, 2, 4, 6, 7], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match="expected at least 2 CPUs for 2 ranks; found 1"):
        rehearsal.cpu_bind([3], 2)


def test_a_qwen_vl_wrapper_from_config_alone_gets_a_stand_in_image_processor(tmp_path):
    """Qwen3.5's published config.json alone: the plan goes ahead with a note, and the stand-in
    takes the patch and merge sizes from vision_config; a wrapper outside the Qwen-VL family, or
    one whose vision_config lacks the sizes, is still one line naming preprocessor_config.json."""
    cfg = json.loads((CONFIGS / "qwen3.5-27b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = rehearsal.plan(tmp_path, None, 1, None)
    assert any("image processor: a stand-in" in n for n in p["notes"]), p["notes"]
    got = rehearsal.stand_in_image_processor(cfg)
    v = cfg["vision_config"]
    assert (got["patch_size"], got["temporal_patch_size"], got["merge_size"]) == (
        v["patch_size"], v["temporal_patch_size"], v["spatial_merge_size"])
    for bad in (dict(cfg, model_type="llava"), dict(cfg, vision_config=dict(v, patch_size=None))):
        (tmp_path / "config.json").write_text(json.dumps(bad))
        assert rehearsal.stand_in_image_processor(bad) is None
        with pytest.raises(rehearsal.CannotRehearse, match="needs the model folder with preprocessor_config.json"):
            rehearsal.plan(tmp_path, None, 1, None)


def test_own_forward_failure_names_the_exception_not_a_cut_fragment():
    """The recorded error is the tail of a traceback (cut mid-word at its start): the line shown is
    the exception's, as in the H100 run where a second process disturbed vLLM's memory profiling."""
    res = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "rehearsal"
    cell = json.loads((res / "gpu-h100_spec-0.4.0.1_vllm-0.24.0_kimi-k2.5_9304329_beside_deepseek.json").read_text())
    line = rehearsal._own_forward_line(cell["models"]["kimi-k2.5"]["settled"])
    assert line.startswith("vLLM's own forward (shim off) could not run: RuntimeError: Worker failed with error "
                           "'Error in memory profiling."), line
    cut = "ofiling during init.\n  File \"x.py\", line 3, in f\nValueError: expected 4 rows; found 3\n"
    assert rehearsal._own_forward_line({"error": cut}).endswith("ValueError: expected 4 rows; found 3")
    assert rehearsal._own_forward_line({"error": "no exception here\nsecond"}).endswith("no exception here")
