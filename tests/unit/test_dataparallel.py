"""Data-parallel extraction's shard mechanics: files in speculators' format, markers, resume.

A fake generator stands in for vLLM here and files are pickled instead of ``torch.save``d
(mechanics only; this venv has no torch). The real thing — real vLLM, on Ray, files read back
with ``torch.load`` — is tests/e2e/test_ray.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pickle

from speculators_compat import dataparallel  # noqa: E402

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"

FAKE = textwrap.dedent(
    """
    import os, signal

    class FakeGenerator:
        '''Deterministic states (lists) from the token ids; logs calls; may SIGKILL itself.'''
        layer_ids = [0, 2]

        def __init__(self, kill_at_call=None, log=None):
            self.calls, self.kill_at_call, self.log = 0, kill_at_call, log

        def generate(self, token_ids):
            self.calls += 1
            if self.log:
                with open(self.log, "a") as f:
                    f.write(repr([list(t) for t in token_ids]) + "\\n")
            if self.calls == self.kill_at_call:
                os.kill(os.getpid(), signal.SIGKILL)
            out = []
            for ids in token_ids:
                ids = list(ids[:6])
                states = [[[t * j + k / 3 for j in range(1, 5)] for t in ids] for k in self.layer_ids]
                out.append({"input_ids": ids, "hidden_states": states, "loss_mask": None})
            return out
    """
)


def _shards():
    return [
        [[1, 2, 3], {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 1, 1, 1]}, [8]],
        [[9, 10, 11, 12, 13, 14, 15, 16], [17, 18]],  # the first is truncated to 6 by the fake
        [[19, 20], [21, 22, 23]],
    ]


def _run(tmp_path: Path, out: Path, kill_at_call=None, log=None) -> subprocess.CompletedProcess:
    (tmp_path / "fake_generator.py").write_text(FAKE)
    script = textwrap.dedent(
        f"""
        import json, pickle, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from fake_generator import FakeGenerator
        from speculators_compat import dataparallel
        shards = json.loads({json.dumps(_shards())!r})
        gen = FakeGenerator(kill_at_call={kill_at_call!r}, log={str(log) if log else None!r})
        def save(data, path):
            with open(path, "wb") as f:
                pickle.dump(data, f)
        summary = dataparallel.extract_local(gen, shards, {str(out)!r}, batch_size=2, save=save)
        print("SUMMARY " + json.dumps({{k: v for k, v in summary.items() if k != "per_shard"}}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env.update(PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), SPECULATORS_COMPAT_DISABLE="1")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


def _files(out: Path) -> dict:
    return {p.name: pickle.loads(p.read_bytes()) for p in sorted(out.glob("data_*.pt"))}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[name] == b[name] for name in a)


def _summary(proc) -> dict:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert line, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(line[-1][len("SUMMARY "):])


def test_files_are_speculators_format_with_global_indices(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, out)
    s = _summary(proc)
    assert s["shards"] == 3 and s["computed"] == 3 and s["samples"] == 7
    files = _files(out)
    assert sorted(files) == sorted(f"data_{i}.pt" for i in range(7))
    d1 = files["data_1.pt"]
    assert set(d1) == {"input_ids", "hidden_states", "loss_mask"}
    assert d1["input_ids"] == [4, 5, 6, 7] and d1["loss_mask"] == [0, 1, 1, 1]
    assert files["data_0.pt"]["loss_mask"] is None
    assert len(files["data_3.pt"]["input_ids"]) == 6  # truncated by the generator
    assert [len(h) for h in files["data_3.pt"]["hidden_states"]] == [6, 6]
    # one progress line per finished shard, with tok/s
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("shard ")]
    assert len(lines) == 3 and all("tok/s" in ln for ln in lines), proc.stdout


def test_killed_run_resumes_skipping_finished_shards_and_redoing_the_cut_one(tmp_path):
    clean = tmp_path / "clean"
    _summary(_run(tmp_path, clean))
    reference = _files(clean)

    out = tmp_path / "out"
    # batch_size 2: shard 0 = calls 1-2, shard 1 = call 3; SIGKILL at call 4 (shard 2, nothing of it written)
    killed = _run(tmp_path, out, kill_at_call=4)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert (out / ".shards" / "shard_000000.json").exists() and (out / ".shards" / "shard_000001.json").exists()
    assert not (out / ".shards" / "shard_000002.json").exists()

    log = tmp_path / "calls.log"
    s = _summary(_run(tmp_path, out, log=log))
    assert s["skipped"] == 2 and s["computed"] == 1, s
    # the finished shards were not recomputed: only shard 2's sequences reached the generator
    assert log.read_text().splitlines() == [repr([[19, 20], [21, 22, 23]])]
    assert _same(_files(out), reference)


def test_half_written_shard_is_redone(tmp_path):
    clean = tmp_path / "clean"
    _summary(_run(tmp_path, clean))
    reference = _files(clean)

    out = tmp_path / "out"
    # shard 0 = calls 1 ([1,2,3],[4..7]) and 2 ([8]): killed at call 2, data_0/data_1 written, no marker
    killed = _run(tmp_path, out, kill_at_call=2)
    assert killed.returncode == -signal.SIGKILL
    assert (out / "data_0.pt").exists() and not (out / ".shards" / "shard_000000.json").exists()
    (out / "data_1.pt").write_bytes((out / "data_1.pt").read_bytes()[:20])  # a torn file
    (out / ".data_2.pt.999.tmp").write_bytes(b"partial")  # a temporary file left by the kill

    log = tmp_path / "calls.log"
    s = _summary(_run(tmp_path, out, log=log))
    assert s["skipped"] == 0 and s["computed"] == 3
    assert log.read_text().splitlines()[0] == repr([[1, 2, 3], [4, 5, 6, 7]])
    assert _same(_files(out), reference)


def test_marker_for_other_inputs_is_not_trusted(tmp_path):
    shards = [[[1, 2]], [[3, 4]]]
    specs = dataparallel.plan(shards, [0, 2])
    out = tmp_path / "out"
    (out / ".shards").mkdir(parents=True)
    specs[0].marker(out).write_text(json.dumps(specs[0].as_dict()))
    assert [s.index for s in dataparallel.pending(specs, out)] == [1]
    other = dataparallel.plan([[[1, 3]], [[3, 4]]], [0, 2])  # shard 0's tokens changed
    assert [s.index for s in dataparallel.pending(other, out)] == [0, 1]
    other_layers = dataparallel.plan(shards, [0, 1])
    assert [s.index for s in dataparallel.pending(other_layers, out)] == [0, 1]
    specs[1].marker(out).write_text("{not json")
    assert [s.index for s in dataparallel.pending(specs, out)] == [1]


def test_the_comparison_can_fail(tmp_path):
    """_same is no test that cannot fail: one changed value is caught."""
    clean = tmp_path / "clean"
    _summary(_run(tmp_path, clean))
    a = _files(clean)
    b = _files(clean)
    b["data_4.pt"]["hidden_states"][1][0][0] += 1e-6
    assert _same(a, a) and not _same(a, b)


@pytest.mark.parametrize("bad,words", [([[]], "shard 0 is empty"), ([[[]]], "non-empty"), ([[[1.5]]], "integer"),
                                        ([[{"ids": [1]}]], "needs 'input_ids'")])
def test_bad_shards_are_one_line(bad, words):
    with pytest.raises(ValueError, match=words) as info:
        dataparallel.plan(bad)
    assert "\n" not in str(info.value)


def test_extract_without_ray_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"speculators-compat\[ray\]"):
        dataparallel.extract("m", [0], [[[1]]], tmp_path, num_actors=2)


def test_reap_kills_recorded_leftovers_and_spares_a_reused_pid(tmp_path):
    """The orphan guard of a failed ``extract``: a recorded pid still running is SIGKILLed after
    the grace; one whose start time differs (a reused pid) and one already gone are left alone."""
    import socket

    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        rec = {"host": socket.gethostname(), "pid": left.pid, "start": dataparallel._start_time(left.pid),
               "descendants": {other.pid: "1", gone.pid: "2"}}
        killed = dataparallel._reap([rec], grace=0.2)
        assert killed == [left.pid]
        assert left.wait(5) == -signal.SIGKILL
        assert other.poll() is None
        assert dataparallel._reap([{**rec, "host": "elsewhere"}], grace=0) == []
    finally:
        for p in (left, other):
            if p.poll() is None:
                p.kill()
                p.wait()
