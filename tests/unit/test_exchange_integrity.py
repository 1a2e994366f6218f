"""Exchange memory has no name: nothing can delete, replace, symlink or leak it; workers open it
through the caller's descriptor and check it is the very file the caller made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from speculators_compat.exchange import ExchangeError, ExchangePool

pytestmark = pytest.mark.unit


def test_chunks_leave_no_name_in_the_folder(tmp_path):
    pool = ExchangePool(str(tmp_path))
    placements, new, _ = pool.allocate({"a": 10_000, "b": 20_000})
    assert new and os.listdir(tmp_path) == []
    ref = new[0].ref()
    st = os.stat(f"/proc/{os.getpid()}/fd/{ref.fd}")
    assert (st.st_dev, st.st_ino, st.st_size) == (ref.dev, ref.ino, ref.size)


def test_a_killed_caller_leaves_nothing_behind(tmp_path):
    """SIGKILL right after the chunk exists (the window a named file would leak in)."""
    code = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(os.path.dirname(os.path.dirname(__import__('speculators_compat').__file__)))!r})
        from speculators_compat.exchange import ExchangePool
        pool = ExchangePool({str(tmp_path)!r})
        pool.allocate({{"a": 64 << 20}})
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env["SPECULATORS_COMPAT_DISABLE"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["missing", "file", "readonly"])
def test_a_bad_shm_dir_is_one_line_naming_the_variable(tmp_path, monkeypatch, kind):
    from speculators_compat.exchange import shm_dir

    target = tmp_path / "x"
    if kind == "file":
        target.write_text("")
    elif kind == "readonly":
        target.mkdir()
        target.chmod(0o500)
        if os.access(target, os.W_OK):  # root ignores the mode bits
            pytest.skip("running as root: a read-only folder is writable")
    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(target))
    with pytest.raises(ExchangeError) as info:
        shm_dir()
    text = str(info.value)
    assert "SPECULATORS_COMPAT_SHM_DIR=" in text and "\n" not in text
