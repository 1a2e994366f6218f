"""``speculators-compat run`` and the ``SPECULATORS_COMPAT_AUTO`` .pth hook, in real interpreters.

Activation is observed as ``speculators_compat`` being imported (importing it activates) before the
main module's first line runs, in the command and in a ``multiprocessing`` spawn child that
re-imports the main module, as speculators' script's children do.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import REPO, subprocess_env

import speculators_compat

pytestmark = pytest.mark.unit

SRC = Path(speculators_compat.__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys
    FIRST = "speculators_compat" in sys.modules  # before this module imports anything else
    import multiprocessing as mp

    def child(q):
        q.put(FIRST)  # this module's FIRST as re-imported in the spawn child (__mp_main__)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        in_child = q.get(timeout=60)
        p.join(60)
        print(f"main={FIRST} child={in_child} main_module_reimported_in_child=ok")
        sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    """
)


def _run(*args: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speculators_compat", *args],
        env=subprocess_env(PYTHONPATH=str(SRC), **env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_activates_the_command_and_its_spawn_children(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = _run("run", sys.executable, str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "main=True child=True" in done.stdout


def test_without_run_nothing_is_activated(tmp_path):
    """The negative control: the same script run plainly sees no shim (the check can fail)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert "main=False child=False" in done.stdout, done.stdout + done.stderr


def test_run_passes_the_exit_code_through(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    assert _run("run", sys.executable, str(script), "7", cwd=tmp_path).returncode == 7
    assert _run("run", "--", sys.executable, "-c", "raise SystemExit(3)").returncode == 3


def test_run_without_a_command_is_one_line():
    done = _run("run")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no command given" in lines[0], done.stderr


def test_run_help():
    done = _run("run", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: speculators-compat run"), done.stdout


def test_run_of_a_missing_command_is_one_line():
    done = _run("run", "no-such-command-speculators-compat")
    assert done.returncode == 127
    lines = done.stderr.strip().splitlines()
    assert lines == ["speculators-compat run: command not found: no-such-command-speculators-compat"], done.stderr


def test_run_chains_to_the_environments_own_sitecustomize(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIR_SITECUSTOMIZE_RAN = True\n")
    code = "import builtins, sys; print(getattr(builtins, 'THEIR_SITECUSTOMIZE_RAN', False), 'speculators_compat' in sys.modules)"
    env = subprocess_env(PYTHONPATH=f"{SRC}:{theirs}")
    done = subprocess.run([sys.executable, "-m", "speculators_compat", "run", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr


def test_run_honours_disable(tmp_path):
    code = "import sys, speculators_compat; print(speculators_compat._STATE.requested)"
    done = _run("run", sys.executable, "-c", code, SPECULATORS_COMPAT_DISABLE="1")
    assert done.stdout.split() == ["False"], done.stdout + done.stderr


def _site_with_pth(tmp_path) -> Path:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(SRC / "speculators_compat_auto.pth", site_dir)
    shutil.copy(SRC / "_speculators_compat_pth.py", site_dir)
    return site_dir


@pytest.mark.parametrize("value,activated", [(None, False), ("0", False), ("off", False), ("1", True), ("yes", True)])
def test_pth_hook_activates_only_when_asked(tmp_path, value, activated):
    site_dir = _site_with_pth(tmp_path)
    code = f"import site, sys; site.addsitedir({str(site_dir)!r}); print('speculators_compat' in sys.modules)"
    extra = {} if value is None else {"SPECULATORS_COMPAT_AUTO": value}
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(PYTHONPATH=str(SRC), **extra),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(activated)], done.stdout + done.stderr
    assert done.stderr == ""


def test_pth_hook_bad_value_is_one_line_and_starts(tmp_path):
    site_dir = _site_with_pth(tmp_path)
    code = f"import site, sys; site.addsitedir({str(site_dir)!r}); print('speculators_compat' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code],
                          env=subprocess_env(PYTHONPATH=str(SRC), SPECULATORS_COMPAT_AUTO="maybe"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECULATORS_COMPAT_AUTO" in lines[0] and "expected one of" in lines[0], done.stderr


def test_wheel_config_ships_the_pth_hook():
    import tomllib

    forced = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert forced.get("src/speculators_compat_auto.pth") == "speculators_compat_auto.pth"
    assert forced.get("src/_speculators_compat_pth.py") == "_speculators_compat_pth.py"
    pth = (REPO / "src" / "speculators_compat_auto.pth").read_text()
    assert pth.startswith("import ") and "_speculators_compat_pth" in pth and len(pth.splitlines()) == 1
