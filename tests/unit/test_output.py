"""output.py without torch or vLLM: the manifest (torn last line, appends), the identity rule,
``verify`` on planted defects (each one named; a clean folder passes; a check is shown to fail
before it is trusted), and the atomic write leaving no partial file."""

from __future__ import annotations

import json

import pytest

from speculators_compat import output

RUN = {"format": 1, "model": "m", "model_config_sha256": "abc", "seq_length": 64, "max_samples": None, "seed": 0,
       "assistant_pattern": None, "turn_dropout": False, "layer_ids": [1, 2], "start_idx": 0, "num_samples": 3,
       "dataset_probe": "p", "writes_sample_lengths": True, "versions": {"vllm": "0.32.0"}}


def make_folder(tmp_path, n=3, lengths=True, config=True):
    m = output.Manifest(tmp_path)
    m.start(dict(RUN, num_samples=n), fsync=False)
    m.append({"data_config": {"hidden_states": {"layer_ids": [1, 2]}}})
    for i in range(n):
        data = bytes([i]) * (100 + i)
        output.atomic_write_bytes(tmp_path / output.data_name(i), data)
        m.append({"file": output.data_name(i), "index": i, "tokens": 10 + i, "layer_ids": [1, 2],
                  "bytes": len(data), "sha256": output.file_sha256(tmp_path / output.data_name(i))})
    if lengths:
        (tmp_path / output.LENGTHS).write_text(json.dumps(m.lengths()))
    if config:
        (tmp_path / output.CONFIG).write_text("{}")
    return m


def kinds(tmp_path, **kw):
    summary, defects = output.verify(tmp_path, **kw)
    return summary, {(d.kind, d.name) for d in defects}


def test_a_complete_folder_verifies(tmp_path):
    make_folder(tmp_path)
    summary, found = kinds(tmp_path)
    assert found == set() and summary["complete"] and summary["recorded_files"] == 3
    assert summary["layer_ids"] == [1, 2]


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "data_1.pt").write_bytes(b"\x01" * 50), ("truncated", "data_1.pt")),
    (lambda d: (d / "data_1.pt").write_bytes(b"\x01" * 500), ("size", "data_1.pt")),
    (lambda d: (d / "data_2.pt").unlink(), ("missing", "data_2.pt")),
    (lambda d: (d / "data_0.pt").write_bytes(b"\x07" * 100), ("checksum", "data_0.pt")),
    (lambda d: (d / "data_9.pt").write_bytes(b"x"), ("foreign", "data_9.pt")),
    (lambda d: (d / ".speculators_compat.data_1.pt.1.2.tmp").write_bytes(b"x"),
     ("partial", ".speculators_compat.data_1.pt.1.2.tmp")),
    (lambda d: (d / output.LENGTHS).write_text('{"0": 10, "1": 99, "2": 12}'), ("lengths", output.LENGTHS)),
    (lambda d: (d / output.LENGTHS).write_text('{"0": 10}'), ("lengths", output.LENGTHS)),
    (lambda d: (d / output.LENGTHS).unlink(), ("missing", output.LENGTHS)),
    (lambda d: (d / output.CONFIG).unlink(), ("missing", output.CONFIG)),
])
def test_each_planted_defect_is_named(tmp_path, damage, expected):
    make_folder(tmp_path)
    damage(tmp_path)
    assert expected in kinds(tmp_path)[1]


def test_checksums_off_reads_sizes_only(tmp_path):
    make_folder(tmp_path)
    (tmp_path / "data_0.pt").write_bytes(b"\x07" * 100)
    assert ("checksum", "data_0.pt") not in kinds(tmp_path, checksums=False)[1]


def test_an_unrecorded_file_of_the_run_is_missing_not_trusted(tmp_path):
    m = make_folder(tmp_path, n=3, lengths=False, config=False)
    lines = m.path.read_text().splitlines()
    m.path.write_text("\n".join(lines[:-1]) + "\n")  # data_2.pt written, its line never appended
    summary, found = kinds(tmp_path)
    assert ("missing", "data_2.pt") in found and not summary["complete"]
    assert ("missing", output.CONFIG) not in found  # an incomplete run owes no data_config.json yet


def test_a_torn_last_line_is_cut_on_reopen(tmp_path):
    make_folder(tmp_path, n=2)
    with open(tmp_path / output.MANIFEST, "ab") as f:
        f.write(b'{"file": "data_2.pt", "ind')
    m = output.Manifest.read(tmp_path)
    assert m.torn and sorted(m.files) == [0, 1] and m.bad_lines == []
    m.reopen(fsync=False)
    m.append({"file": "data_2.pt", "index": 2, "tokens": 5, "layer_ids": [1, 2], "bytes": 1, "sha256": "x"})
    again = output.Manifest.read(tmp_path)
    assert sorted(again.files) == [0, 1, 2] and again.torn == 0 and again.bad_lines == []


def test_no_manifest_is_one_clear_error(tmp_path):
    with pytest.raises(output.OutputRefused, match="no readable speculators_compat_manifest.jsonl"):
        output.verify(tmp_path)
    with pytest.raises(output.OutputRefused, match="not a folder"):
        output.verify(tmp_path / "nope")


def test_identity_names_the_first_difference():
    assert output.identity_mismatch(RUN, dict(RUN)) is None
    assert output.identity_mismatch(RUN, dict(RUN, versions={"vllm": "0.33.0"})) is None  # versions only warn
    assert output.identity_mismatch(RUN, dict(RUN, model="/elsewhere/m")) is None  # same config.json, moved
    msg = output.identity_mismatch(RUN, dict(RUN, layer_ids=[1, 3]))
    assert msg == "layer_ids: expected [1, 2] (the folder's manifest); found [1, 3] (this run)"
    hub = dict(RUN, model_config_sha256=None)
    assert output.identity_mismatch(hub, dict(hub, model="other/model")).startswith("model: expected 'm'")
    assert output.identity_mismatch(RUN, dict(RUN, dataset_probe="q")).startswith("dataset_probe:")


def test_dataset_probe_sees_a_changed_sample_and_size():
    ids = [[1, 2, 3], [4, 5], [6], [7, 8], [9]]
    base = output.dataset_probe(lambda i: ids[i], len(ids))
    assert base == output.dataset_probe(lambda i: ids[i], len(ids))
    changed = [list(x) for x in ids]
    changed[4] = [10]
    assert output.dataset_probe(lambda i: changed[i], 5) != base
    assert output.dataset_probe(lambda i: ids[i], 4) != base
    assert output.dataset_probe(lambda i: ids[i], 0) == output.dataset_probe(lambda i: [], 0)


def test_atomic_write_leaves_old_content_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    output.atomic_write_bytes(p, b"old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(output.os, "replace", boom)
    with pytest.raises(OSError):
        output.atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"old" and [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_a_failed_self_check_is_a_defect_and_passes_are_counted(tmp_path):
    m = make_folder(tmp_path)
    m.append({"self_check": {"batch": 2, "sample": 0, "max_rel_error": 0.01, "verdict": "pass", "problem": None}})
    summary, found = kinds(tmp_path)
    assert found == set() and summary["self_checks"] == 1 and summary["self_check_max_error"] == 0.01
    m.append({"self_check": {"batch": 5, "sample": 0, "max_rel_error": 0.9, "verdict": "fail",
                             "problem": "layer 1 row 3: relative error 0.9 > 0.1"}})
    summary, defects = output.verify(tmp_path)
    assert [str(d) for d in defects] == ["self-check: data_0.pt: batch 5: layer 1 row 3: relative error 0.9 > 0.1"]


def test_a_second_run_cannot_take_a_locked_folder(tmp_path):
    """Two runs in one folder: the second is refused in one line (the first's lock is held by the
    kernel for the first process's life), before it sweeps temporary files or writes anything."""
    import subprocess
    import sys

    from speculators_compat import output

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(output.OutputRefused, match="another run is writing this folder"):
            output.lock_folder(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    output.lock_folder(tmp_path)  # the holder is gone: the kernel released its lock
    output.lock_folder(tmp_path)  # this process again: a no-op
    assert list(tmp_path.iterdir()) == []  # no lock file in the data folder


def test_a_folder_that_cannot_be_locked_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    """Some NFS / Lustre mounts refuse flock (ENOLCK, ENOSYS): the run goes on, and says so."""
    import errno
    import fcntl

    from speculators_compat import output

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.warns(RuntimeWarning, match="cannot be locked .*No locks available"):
        output.lock_folder(tmp_path / ".")
    assert str((tmp_path / ".").resolve()) not in output._LOCKS


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """The lock is the process's, not its forked children's: a child that outlives the run (an
    orphaned worker after a kill) must not make the resume look like a second run."""
    import subprocess
    import sys

    code = ("import os, sys, time; sys.path.insert(0, sys.argv[2]); from speculators_compat import output; "
            "output.lock_folder(sys.argv[1]); pid = os.fork()\n"
            "if pid == 0:\n    os.close(1); os.close(2); time.sleep(30); os._exit(0)\n"
            "print(pid, flush=True); os._exit(0)")
    src = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), src], capture_output=True, text=True, timeout=60)
    child = int(proc.stdout.strip())
    try:
        from speculators_compat import output

        output._LOCKS.pop(str(tmp_path.resolve()), None)
        output.lock_folder(tmp_path)  # the parent is gone, its child alive: the lock is free
    finally:
        import os
        import signal

        os.kill(child, signal.SIGKILL)
