"""matrix.py: the shipped compat_matrix.yaml and every way a matrix file can be wrong."""

from __future__ import annotations

import pytest
import yaml
from _helpers import SHIPPED_MATRIX, matrix_text
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from speculators_compat import matrix as M
from speculators_compat.matrix import (
    TESTED_STATUSES,
    MatrixError,
    PatchRange,
    load_matrix,
    matrix_path,
    parse_matrix,
)
from speculators_compat.patches import all_patches

pytestmark = pytest.mark.unit

IDS = {"alpha", "beta"}


def _valid(**overrides) -> dict:
    data = {
        "schema": 1,
        "patches": {
            "alpha": {"why": "alpha why", "vllm": ">=0.12"},
            "beta": {"why": "beta why", "speculators": ">=0.3.0,<0.5"},
        },
        "tested": [
            {"speculators": "0.4.1", "vllm": "0.12.0", "status": "verified", "platform": "cpu", "evidence": "run 1"},
        ],
        "not_applicable": [{"speculators": ">=0.5", "why": "removed in 0.5"}],
    }
    data.update(overrides)
    return data


def _parse(data_or_text, known=IDS):
    text = data_or_text if isinstance(data_or_text, str) else yaml.safe_dump(data_or_text, sort_keys=False)
    return parse_matrix(text, "m.yaml", known)


def _error(data_or_text, known=IDS) -> str:
    with pytest.raises(MatrixError) as info:
        _parse(data_or_text, known)
    msg = str(info.value)
    assert msg.startswith("m.yaml: "), msg  # names the file
    assert "\n" not in msg, msg
    return msg


# -- the shipped file --------------------------------------------------------------------


def test_shipped_matrix_validates_against_real_patch_ids(clean_env):
    ids = {p.id for p in all_patches()}
    assert len(ids) == len(all_patches())  # ids are unique in code
    m = load_matrix(SHIPPED_MATRIX, known_ids=ids)
    assert set(m.patches) == ids
    assert m.path == str(SHIPPED_MATRIX)
    for pid, rng in m.patches.items():
        assert rng.id == pid
        assert rng.why.strip()
        assert set(rng.ranges) <= {"speculators", "vllm", "transformers", "torch"}
    for row in m.tested:
        assert row.status in TESTED_STATUSES


def test_shipped_matrix_is_the_default_path(clean_env):
    path = matrix_path()  # the packaged copy (wheel) or the repository's file (editable)
    assert path.name == "compat_matrix.yaml" and path.is_file()
    assert path.read_text() == SHIPPED_MATRIX.read_text()
    m = load_matrix(known_ids={p.id for p in all_patches()})
    assert set(m.patches) == {p.id for p in all_patches()}


def test_shipped_matrix_marks_speculators_05_not_applicable(clean_env):
    m = load_matrix(SHIPPED_MATRIX)
    assert m.not_applicable_reason("0.5.0") is not None
    assert "0.5" in m.not_applicable_reason("0.5.0")
    assert m.not_applicable_reason("0.6.0.dev1") is not None
    assert m.not_applicable_reason("0.4.1") is None
    assert m.not_applicable_reason(None) is None


# -- a valid fake file -------------------------------------------------------------------


def test_valid_matrix_parses_to_records():
    m = _parse(_valid())
    assert m.path == "m.yaml"
    assert m.patches["alpha"] == PatchRange("alpha", "alpha why", {"vllm": SpecifierSet(">=0.12")})
    assert m.patches["beta"].ranges == {"speculators": SpecifierSet(">=0.3.0,<0.5")}
    assert m.tested == (M.TestedPair("0.4.1", "0.12.0", "verified", "cpu", "run 1", ""),)
    assert m.not_applicable == ((SpecifierSet(">=0.5"), "removed in 0.5"),)
    assert m.newest_tested_vllm() == Version("0.12.0")


def test_patch_gate_reasons():
    m = _parse(_valid())
    alpha = m.patches["alpha"]
    assert alpha.gate({"vllm": "0.12.0"}) is None
    assert alpha.gate({"vllm": "0.17.0.dev123+gabc"}) is None
    assert alpha.gate({"vllm": "0.11.0.post2"}) == "vllm 0.11.0.post2 outside >=0.12"
    assert alpha.gate({"vllm": None}) == "vllm is not installed (range >=0.12)"
    assert alpha.gate({}) == "vllm is not installed (range >=0.12)"


def test_tested_status_compares_releases():
    m = _parse(_valid())
    assert [r.status for r in m.tested_status("0.4.1", "0.12.0rc2")] == ["verified"]
    assert [r.status for r in m.tested_status("0.4.1.post1", "0.12.0+cpu")] == ["verified"]
    assert m.tested_status("0.4.1", "0.13.0") == []
    assert m.tested_status(None, "0.12.0") == []
    assert m.tested_status("0.4.1", "garbage") == []


def test_not_applicable_for_speculators_05_and_later():
    m = _parse(_valid())
    assert m.not_applicable_reason("0.5.0") == "removed in 0.5"
    assert m.not_applicable_reason("0.5.0rc1") == "removed in 0.5"
    assert m.not_applicable_reason("0.4.9") is None


def test_tested_and_not_applicable_may_be_empty_or_absent():
    data = _valid()
    del data["tested"], data["not_applicable"]
    m = _parse(data)
    assert m.tested == () and m.not_applicable == ()
    assert m.newest_tested_vllm() is None
    assert _parse(_valid(tested=[], not_applicable=[])).tested == ()


def test_without_known_ids_no_cross_check():
    m = parse_matrix(yaml.safe_dump(_valid()), "m.yaml", None)
    assert set(m.patches) == IDS


# -- malformed files: one MatrixError naming the key -------------------------------------


def test_malformed_yaml():
    msg = _error("schema: 1\npatches: {alpha: [\n")
    assert "not valid YAML" in msg


def test_empty_file():
    msg = _error("")
    assert msg == "m.yaml: expected a mapping, found NoneType"


def test_top_level_not_a_mapping():
    assert _error("- 1\n- 2\n") == "m.yaml: expected a mapping, found list"


def test_missing_schema_key():
    data = _valid()
    del data["schema"]
    assert _error(data) == "m.yaml: key 'schema' must be 1, found None"


def test_wrong_schema_version():
    assert _error(_valid(schema=2)) == "m.yaml: key 'schema' must be 1, found 2"


def test_partial_file_without_patches():
    data = _valid()
    del data["patches"]
    msg = _error(data)
    assert msg == "m.yaml: patches: no entry for patch id 'alpha'"


def test_patch_missing_required_key():
    data = _valid()
    del data["patches"]["alpha"]["why"]
    assert _error(data) == "m.yaml: patches.alpha: missing key 'why'"


def test_family_is_declared_in_code_not_in_the_matrix():
    data = _valid()
    data["patches"]["alpha"]["family"] = "kv-cache"
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.alpha: unknown key 'family' (allowed: ")
    assert msg.endswith("a patch's family is declared in its code (Patch.family), not here")


def test_requires_in_the_matrix_points_to_the_code():
    data = _valid()
    data["patches"]["beta"]["requires"] = ["alpha"]
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.beta: unknown key 'requires' (allowed: ")
    assert msg.endswith("a patch's dependencies are declared in its code (Patch.requires), not here")


def test_patch_empty_why():
    data = _valid()
    data["patches"]["alpha"]["why"] = "  "
    assert _error(data) == "m.yaml: patches.alpha.why: expected a non-empty string, found '  '"


def test_patch_body_not_a_mapping():
    data = _valid()
    data["patches"]["alpha"] = ">=0.12"
    assert _error(data) == "m.yaml: patches.alpha: expected a mapping, found str"


def test_unknown_top_level_key():
    msg = _error(_valid(patchez={}))
    assert msg.startswith("m.yaml: unknown key 'patchez' (allowed: ")


def test_unknown_key_inside_patch():
    data = _valid()
    data["patches"]["alpha"]["vlm"] = ">=0.12"
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.alpha: unknown key 'vlm' (allowed: ")
    assert "vllm" in msg


@pytest.mark.parametrize("bad", [">>0.12", "0.12", ">=abc", "~=1"])
def test_bad_specifier(bad):
    data = _valid()
    data["patches"]["alpha"]["vllm"] = bad
    msg = _error(data)
    assert msg.startswith(f"m.yaml: patches.alpha.vllm: bad version specifier {bad!r}"), msg


def test_specifier_must_be_a_string():
    data = _valid()
    data["patches"]["alpha"]["vllm"] = 0.12
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.alpha.vllm: expected a specifier string"), msg


def test_unknown_patch_id():
    data = _valid()
    data["patches"]["gamma"] = {"why": "y"}
    assert _error(data) == "m.yaml: patches.gamma: unknown patch id (no such patch in code)"


def test_missing_patch_id():
    data = _valid()
    del data["patches"]["beta"]
    assert _error(data) == "m.yaml: patches: no entry for patch id 'beta'"


def test_duplicate_patch_id_is_refused_not_collapsed():
    text = matrix_text({"alpha": {}, "beta": {}})
    lines = text.splitlines()
    start = lines.index("  alpha:")
    dup = lines[start : start + 2]  # alpha: / why
    assert dup[1].strip().startswith("why")
    text = "\n".join(lines[: start + 2] + dup + lines[start + 2 :]) + "\n"
    msg = _error(text)
    assert "duplicate key 'alpha'" in msg
    assert msg.startswith("m.yaml: duplicate key 'alpha' (line ")


def test_duplicate_key_inside_patch():
    text = "schema: 1\npatches:\n  alpha:\n    vllm: '>=0.12'\n    why: b\n    why: c\n  beta: {why: b}\n"
    msg = _error(text)
    assert msg == "m.yaml: duplicate key 'why' (line 6; first at line 5)"


# -- the tested table --------------------------------------------------------------------


def test_tested_bad_status():
    data = _valid()
    data["tested"][0]["status"] = "works"
    assert _error(data) == "m.yaml: tested[0].status: 'works' is not one of verified, broken, untested, stale"


def test_tested_duplicate_pair():
    row = {"speculators": "0.4.1", "vllm": "0.12.0", "status": "verified", "platform": "cpu"}
    data = _valid(tested=[row, {**row, "status": "broken"}])
    assert _error(data) == "m.yaml: tested[1]: duplicate row for speculators 0.4.1, vllm 0.12.0, platform cpu"


def test_tested_same_pair_on_two_platforms_is_fine():
    row = {"speculators": "0.4.1", "vllm": "0.12.0", "status": "verified", "platform": "cpu"}
    m = _parse(_valid(tested=[row, {**row, "platform": "cuda"}]))
    assert [r.platform for r in m.tested_status("0.4.1", "0.12.0")] == ["cpu", "cuda"]


def test_tested_status_for_one_platform_leaves_the_others_out():
    """A pair verified on CPU only is not verified for a CUDA build of the same vLLM release."""
    row = {"speculators": "0.4.1", "vllm": "0.12.0", "status": "verified", "platform": "cpu"}
    m = _parse(_valid(tested=[row, {**row, "vllm": "0.13.0", "platform": "cuda", "status": "stale"}]))
    assert [r.platform for r in m.tested_status("0.4.1", "0.12.0", "cpu")] == ["cpu"]
    assert m.tested_status("0.4.1", "0.12.0", "cuda") == []
    assert [r.status for r in m.tested_status("0.4.1", "0.13.0+cu129", "cuda")] == ["stale"]


def test_tested_missing_key():
    data = _valid(tested=[{"speculators": "0.4.1", "status": "verified"}])
    assert _error(data) == "m.yaml: tested[0]: missing key 'vllm'"


def test_tested_unknown_key():
    data = _valid()
    data["tested"][0]["result"] = "ok"
    assert _error(data).startswith("m.yaml: tested[0]: unknown key 'result' (allowed: ")


def test_tested_bad_version():
    data = _valid()
    data["tested"][0]["vllm"] = "latest"
    assert _error(data) == "m.yaml: tested[0].vllm: 'latest' is not a version"


def test_tested_version_written_as_yaml_float_is_refused():
    # `vllm: 0.10` is the float 0.1 in YAML: silently reading it as vLLM 0.1 would be wrong
    text = yaml.safe_dump(_valid(tested=[]), sort_keys=False).replace(
        "tested: []", "tested:\n- {speculators: '0.4.1', vllm: 0.10, status: verified}"
    )
    msg = _error(text)
    assert msg == "m.yaml: tested[0].vllm: expected a quoted version string such as '0.12.0', found 0.1"


def test_not_applicable_row_checked():
    assert _error(_valid(not_applicable=[{"speculators": ">=0.5"}])) == (
        "m.yaml: not_applicable[0]: needs keys 'speculators' and 'why'"
    )
    msg = _error(_valid(not_applicable=[{"speculators": "=>0.5", "why": "x"}]))
    assert msg.startswith("m.yaml: not_applicable[0].speculators: bad version specifier '=>0.5'"), msg


# -- data only ---------------------------------------------------------------------------


def test_python_object_tag_is_refused():
    text = yaml.safe_dump(_valid(), sort_keys=False) + "x: !!python/object/apply:os.system ['echo pwned']\n"
    msg = _error(text)
    assert "not valid YAML" in msg
    assert "python/object" in msg


def test_python_object_tag_in_a_patch_is_refused():
    text = "schema: 1\npatches:\n  alpha: !!python/object:builtins.dict {}\n"
    msg = _error(text)
    assert "python/object" in msg


# -- a user's own file -------------------------------------------------------------------


def test_user_matrix_from_env_is_used(clean_env, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_valid()))
    clean_env.setenv("SPECULATORS_COMPAT_MATRIX", str(path))
    assert matrix_path() == path
    m = load_matrix(known_ids=IDS)
    assert m.path == str(path)
    assert set(m.patches) == IDS


def test_user_matrix_from_env_is_validated_the_same_way(clean_env, tmp_path):
    path = tmp_path / "mine.yaml"
    data = _valid()
    data["patches"]["alpha"]["vllm"] = ">>0.12"
    path.write_text(yaml.safe_dump(data))
    clean_env.setenv("SPECULATORS_COMPAT_MATRIX", str(path))
    with pytest.raises(MatrixError) as info:
        load_matrix(known_ids=IDS)
    assert str(info.value).startswith(f"{path}: patches.alpha.vllm: bad version specifier '>>0.12'")


def test_user_matrix_missing_file(clean_env, tmp_path):
    path = tmp_path / "absent.yaml"
    clean_env.setenv("SPECULATORS_COMPAT_MATRIX", str(path))
    with pytest.raises(MatrixError) as info:
        load_matrix(known_ids=IDS)
    assert str(info.value).startswith(f"{path}: cannot read the matrix file (")


# -- limits: size, anchors/aliases, bounded messages ---------------------------------------

_LAYERS = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
    f"&{n} [{','.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")
]
# issue #16's bomb: a why whose repr() (in the "expected a string" error) is 9**9 * 5 lols
_BOMB = "schema: 1\npatches:\n  alpha: {why: a}\n  beta:\n    why: [" + ", ".join(_LAYERS) + "]\n"


def _timed_error(fn) -> tuple[str, float]:
    import time

    start = time.perf_counter()
    with pytest.raises(MatrixError) as info:
        fn()
    return str(info.value), time.perf_counter() - start


@pytest.mark.parametrize("where", ["text", "file", "env"])
def test_alias_bomb_is_refused_at_once_in_one_line(where, tmp_path, clean_env):
    assert len(_BOMB) < 1024
    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB)
    clean_env.setenv("SPECULATORS_COMPAT_MATRIX", str(path))
    fn = {
        "text": lambda: parse_matrix(_BOMB, "m.yaml", IDS),
        "file": lambda: load_matrix(path, known_ids=IDS),
        "env": lambda: load_matrix(known_ids=IDS),
    }[where]
    msg, seconds = _timed_error(fn)
    assert seconds < 0.2, seconds
    assert msg.endswith(": line 5: YAML anchor 'a' refused (the matrix allows no anchors or aliases)"), msg
    assert "\n" not in msg and len(msg) <= M.MAX_MESSAGE


def test_an_alias_alone_is_refused_too():
    text = yaml.safe_dump(_valid(), sort_keys=False) + "extra: *nowhere\n"
    line = text.count("\n")
    assert _error(text) == f"m.yaml: line {line}: YAML alias 'nowhere' refused (the matrix allows no anchors or aliases)"


def test_a_50_mb_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "w") as f:
        f.write(yaml.safe_dump(_valid(), sort_keys=False))
        f.write("# " + "x" * (50 * 1024 * 1024) + "\n")
    msg, seconds = _timed_error(lambda: load_matrix(path, known_ids=IDS))
    assert seconds < 0.5, seconds
    assert msg == f"{path}: over the 1048576-byte limit of a matrix file; refused unread"
    msg, seconds = _timed_error(lambda: parse_matrix(path.read_text(), "m.yaml", IDS))
    assert seconds < 0.5, seconds
    assert msg == f"m.yaml: {path.stat().st_size} characters, over the 1048576-byte limit of a matrix file"


def test_a_file_just_under_the_cap_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    text = yaml.safe_dump(_valid(), sort_keys=False)
    path.write_text(text + "#" * (M.MAX_BYTES - len(text) - 1) + "\n")
    assert path.stat().st_size == M.MAX_BYTES
    assert set(load_matrix(path, known_ids=IDS).patches) == IDS


def test_errors_quote_huge_values_in_a_few_hundred_characters():
    data = _valid()
    data["patches"]["alpha"]["why"] = [{"k": "x" * 1000 + str(i)} for i in range(800)]  # ~800 KB if repr()'d whole
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.alpha.why: expected a non-empty string, found [")
    assert len(msg) <= M.MAX_MESSAGE
    data = _valid()
    data["patches"]["alpha"]["y" * 10_000] = 1
    msg = _error(data)
    assert msg.startswith("m.yaml: patches.alpha: unknown key 'yyyy") and len(msg) <= M.MAX_MESSAGE


@pytest.mark.parametrize("opener", ["[", "{a: "])
def test_deep_nesting_is_refused_at_once_in_one_line(opener):
    text = "schema: 1\npatches: " + opener * 200_000 + "\n"
    assert len(text) < M.MAX_BYTES
    msg, seconds = _timed_error(lambda: parse_matrix(text, "m.yaml", IDS))
    assert seconds < 0.2, seconds
    assert msg == "m.yaml: line 2: nested deeper than 32 levels"


def test_deep_block_nesting_is_one_line_error():
    text = "schema: 1\npatches:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(1200))
    assert len(text) < M.MAX_BYTES
    msg, seconds = _timed_error(lambda: parse_matrix(text, "m.yaml", IDS))
    assert seconds < 1, seconds
    assert msg == "m.yaml: not valid YAML: nested too deeply"


def test_tested_row_text_fields_must_be_text():
    data = _valid()
    data["tested"][0]["evidence"] = {"nested": ["x"] * 10}
    assert _error(data) == "m.yaml: tested[0].evidence: expected text, found a dict"
