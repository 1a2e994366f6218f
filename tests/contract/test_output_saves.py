"""output.SaveQueue and save_tensor_file with real torch: files load back equal with the recorded
size and checksum, the bytes waiting to be saved stay under the bound however slow the disk, and a
failed save stops the loop with its cause instead of being lost in a thread."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.pool import ThreadPool

import pytest

torch = pytest.importorskip("torch")

from speculators_compat import child, output  # noqa: E402


def sample(rows: int, hidden: int = 64, layers: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.arange(rows), "loss_mask": torch.ones(rows, dtype=torch.long),
            "hidden_states": [torch.randn(rows, hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]}


def test_saved_files_load_back_and_match_their_record(tmp_path):
    m = output.Manifest(tmp_path)
    m.start({"num_samples": 4, "start_idx": 0}, fsync=False)
    q = output.SaveQueue(m, workers=2, limit_bytes=1 << 20, fsync=True)
    samples = [sample(10 + i, seed=i) for i in range(4)]
    for i, s in enumerate(samples):
        q.submit(i, output.data_name(i), s, len(s["input_ids"]), [1, 2, 3])
    q.drain()
    again = output.Manifest.read(tmp_path)
    assert sorted(again.files) == [0, 1, 2, 3] and q.saved == 4
    for i, s in enumerate(samples):
        p = tmp_path / output.data_name(i)
        rec = again.files[i]
        assert rec["bytes"] == p.stat().st_size and rec["sha256"] == output.file_sha256(p)
        back = torch.load(p, weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], s["hidden_states"], strict=True))
    assert not list(tmp_path.glob(".speculators_compat.*"))


def test_the_same_sample_gives_the_same_bytes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = output.save_tensor_file(sample(7), tmp_path / "a" / "data_1.pt")
    b = output.save_tensor_file(sample(7), tmp_path / "b" / "data_1.pt")
    assert a == b and (tmp_path / "a" / "data_1.pt").read_bytes() == (tmp_path / "b" / "data_1.pt").read_bytes()


def test_the_bytes_are_those_of_torch_save_to_the_same_name(tmp_path):
    (tmp_path / "ref").mkdir()
    torch.save(sample(9, seed=5), str(tmp_path / "ref" / "data_3.pt"))
    size, sha = output.save_tensor_file(sample(9, seed=5), tmp_path / "data_3.pt")
    data = (tmp_path / "data_3.pt").read_bytes()
    assert data == (tmp_path / "ref" / "data_3.pt").read_bytes()
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_3.pt", "ref"]


def test_a_failed_save_leaves_nothing(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    obj = sample(64)
    obj["z"] = Unpicklable()  # torch pickles first: it fails before the tensors, its archive begun
    with pytest.raises(OSError, match="No space left"):
        output.save_tensor_file(obj, tmp_path / "data_0.pt")
    assert list(tmp_path.iterdir()) == []


_FULL = """
import json, resource, signal, sys, torch
from pathlib import Path
from speculators_compat import output
obj = {"hidden_states": [torch.ones(512, 64)]}
folder, short = Path(sys.argv[1]), int(sys.argv[2])
torch.save(obj, str(folder.parent / "whole.pt"))
limit = (folder.parent / "whole.pt").stat().st_size - short
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the disk fills `short` bytes before the end
try:
    output.save_tensor_file(obj, folder / "data_0.pt")
    print(json.dumps(None))
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""


@pytest.mark.parametrize("short", [100_000, 1], ids=["mid-tensor", "last-byte"])
def test_a_write_error_inside_torch_is_raised_with_the_file_and_leaves_nothing(tmp_path, short):
    # torch <= 2.9 closes its file unchecked: a tail lost there raised nothing (vLLM 0.11-0.14's torch)
    folder = tmp_path / "out"
    folder.mkdir()
    run = subprocess.run([sys.executable, "-c", _FULL, str(folder), str(short)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result is not None, "a save cut short was reported as saved"
    kind, message = result
    assert kind == "OSError" and "data_0.pt" in message and "free on its file system" in message, message
    assert list(folder.iterdir()) == []


def test_an_error_that_is_not_the_disk_keeps_its_type(tmp_path, monkeypatch):
    def broken(obj, f):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        output.save_tensor_file(sample(4), tmp_path / "data_0.pt")
    assert list(tmp_path.iterdir()) == []


_CRASH = """
import os, sys, torch
from pathlib import Path
from speculators_compat import output
os.replace = lambda *a: os._exit(9)  # killed after torch wrote the whole file, before the rename
g = torch.Generator().manual_seed(0)
output.save_tensor_file({"hidden_states": [torch.randn(256, 64, generator=g)]}, Path(sys.argv[1]) / "data_0.pt")
"""


def test_a_save_cut_off_by_a_crash_is_not_a_training_file(tmp_path):
    data = pytest.importorskip("speculators.train.data")
    run = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 9, run.stderr
    left = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert left and all(p.stat().st_size > 0 for p in left)  # the cut-off save is there ...
    assert not any(p.name.endswith("pt") for p in left)
    assert data.list_files(tmp_path) == []  # ... and speculators' training loader does not take it
    assert output.data_files(tmp_path) == {}
    swept = list(tmp_path.glob(output._TMP_PREFIX + "*"))  # what the next run's start removes
    assert all(any(d in p.parents for d in swept) for p in left), (left, swept)


@pytest.mark.parametrize("cores, threads", [(2, 4), (8, 4), (12, 6), (16, 8), (128, 8)])
def test_save_threads_cover_the_hash(monkeypatch, cores, threads):
    monkeypatch.setattr(output, "_usable_cores", lambda: cores)
    assert output.save_workers(4) == threads and output.save_workers(0) == max(1, min(8, cores // 2))


@pytest.mark.parametrize("cpu_max, cores", [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1),
                                            ("garbage\n", None)])
def test_a_containers_cpu_quota_bounds_the_cores(tmp_path, monkeypatch, cpu_max, cores):
    (tmp_path / "cpu.max").write_text(cpu_max)
    (tmp_path / "self").write_text("0::/\n")
    monkeypatch.setattr(output, "_CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(output, "_SELF_CGROUP", tmp_path / "self")
    affinity = len(os.sched_getaffinity(0))
    assert output._usable_cores() == (affinity if cores is None else min(affinity, cores))


@pytest.mark.parametrize("quotas, cores", [({"": "max", "a": "100000 100000", "a/b": "max"}, 1),
                                           ({"": "50000 100000", "a": "max", "a/b": "max"}, 1),
                                           ({"": "max", "a": "max", "a/b": "max"}, None),
                                           ({"": "max", "a": "300000 100000"}, 3)])
def test_a_quota_of_a_cgroup_above_this_ones_bounds_the_cores(tmp_path, monkeypatch, quotas, cores):
    for rel, quota in quotas.items():
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "cpu.max").write_text(quota + "\n")
    (tmp_path / "a" / "b").mkdir(parents=True, exist_ok=True)  # this process's cgroup, without cpu.max if absent
    (tmp_path / "self").write_text("1:name=systemd:/x\n0::/a/b\n")
    monkeypatch.setattr(output, "_CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(output, "_SELF_CGROUP", tmp_path / "self")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert output._usable_cores() == (16 if cores is None else cores)


# -- the checksum helper process ---------------------------------------------------------------


@pytest.fixture
def fresh_helpers(monkeypatch):
    monkeypatch.setattr(output, "_helper_broken", [])
    output._BUFFER.helper, output._BUFFER.helper_lost = None, False
    yield
    output._BUFFER.helper, output._BUFFER.helper_lost = None, False


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_saves_are_hashed_by_a_helper_process_that_ends_with_its_thread(tmp_path, fresh_helpers, monkeypatch):
    procs, results = [], []

    def nowhere(*args, **kwargs):
        raise AssertionError("hashed in this process")

    monkeypatch.setattr(output, "_digest", nowhere)

    def save():
        results.append(output.save_tensor_file(sample(300), tmp_path / "data_0.pt", fsync=True))
        procs.append(output._BUFFER.helper.proc)

    th = threading.Thread(target=save)
    th.start()
    th.join()
    assert results == [((tmp_path / "data_0.pt").stat().st_size, _sha(tmp_path / "data_0.pt"))]
    for _ in range(100):  # the thread is gone: its helper's input closes and it exits
        if procs[0].poll() is not None:
            break
        gc.collect()
        time.sleep(0.05)
    assert procs[0].returncode == 0


def test_threads_and_a_relative_folder_after_chdir_get_their_own_files_digests(tmp_path, fresh_helpers, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    (tmp_path / "a" / "x").write_bytes(b"in a")
    assert output._digest_saved(output.Path("x"), False) == (4, hashlib.sha256(b"in a").hexdigest())
    monkeypatch.chdir(tmp_path / "b")  # the helper started in a; a relative name is this process's
    (tmp_path / "b" / "x").write_bytes(b"in b, longer")
    assert output._digest_saved(output.Path("x"), False) == (12, hashlib.sha256(b"in b, longer").hexdigest())
    with ThreadPool(4) as pool:
        got = pool.map(lambda i: output.save_tensor_file(sample(20 + i, seed=i), tmp_path / f"data_{i}.pt"), range(16))
    assert got == [((tmp_path / f"data_{i}.pt").stat().st_size, _sha(tmp_path / f"data_{i}.pt")) for i in range(16)]


def test_a_helper_that_dies_mid_request_costs_nothing_but_speed(tmp_path, fresh_helpers):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    helper = output._helper()

    def kill_then_write():  # the helper blocks opening the FIFO, then dies with the request taken
        time.sleep(0.5)
        helper.proc.kill()
        helper.proc.wait()  # gone before the FIFO has a writer: the bytes go to the fallback's read
        with open(fifo, "wb") as f:  # for the read this process falls back to
            f.write(b"abc")

    th = threading.Thread(target=kill_then_write, daemon=True)
    th.start()
    got = [output._digest_saved(fifo, False)]
    th.join(10)
    assert got == [(3, hashlib.sha256(b"abc").hexdigest())] and output._helper_broken == []
    (tmp_path / "x").write_bytes(b"xyz")
    assert output._digest_saved(tmp_path / "x", False) == (3, hashlib.sha256(b"xyz").hexdigest())
    assert output._BUFFER.helper is not None and output._BUFFER.helper is not helper  # a new one


def test_a_second_loss_keeps_hashing_here_with_one_warning(tmp_path, fresh_helpers, monkeypatch):
    (tmp_path / "x").write_bytes(b"xyz")
    real = output._helper

    def dead():  # each helper dies before its request is written
        h = real()
        if h is not None:
            h.proc.kill()
            h.proc.wait()
        return h

    monkeypatch.setattr(output, "_helper", dead)
    assert output._digest_saved(tmp_path / "x", False) == (3, hashlib.sha256(b"xyz").hexdigest())
    assert output._helper_broken == []
    with pytest.warns(RuntimeWarning, match="checksummed in this process .*twice"):
        assert output._digest_saved(tmp_path / "x", False) == (3, hashlib.sha256(b"xyz").hexdigest())
    assert real() is None


def test_an_interrupted_request_never_answers_the_next(tmp_path, fresh_helpers, monkeypatch):
    (tmp_path / "big").write_bytes(os.urandom(1 << 20))
    (tmp_path / "small").write_bytes(os.urandom(1 << 20))  # the same size: only the digest tells them apart
    real, calls = output._Helper._line, []

    def interrupted(self, timeout=None):
        calls.append(timeout)
        if len(calls) == 1 and timeout is None:
            raise KeyboardInterrupt
        return real(self, timeout)

    output._helper()
    monkeypatch.setattr(output._Helper, "_line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output._digest_saved(tmp_path / "big", False)
    assert output._digest_saved(tmp_path / "small", False) == (1 << 20, _sha(tmp_path / "small"))


@pytest.mark.parametrize("program", ["echo 'Usage 12 deadbeef'", "echo 'OK 12 ' && sleep 30", "sleep 30"])
def test_an_executable_that_is_not_a_helper_is_refused(tmp_path, fresh_helpers, monkeypatch, program):
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\n{program}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(output, "_READY_S", 1.0)
    (tmp_path / "x").write_bytes(b"xyz")
    with pytest.warns(RuntimeWarning, match="fake-python -I -S could not start"):
        assert output._digest_saved(tmp_path / "x", False) == (3, hashlib.sha256(b"xyz").hexdigest())


def test_without_a_helper_hashing_stays_here_with_one_warning(tmp_path, fresh_helpers, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.warns(RuntimeWarning, match="no-python -I -S could not start"):
        size, sha = output.save_tensor_file(sample(40), tmp_path / "data_0.pt")
    assert (size, sha) == ((tmp_path / "data_0.pt").stat().st_size, _sha(tmp_path / "data_0.pt"))


def test_a_helpers_read_error_is_an_os_error_naming_the_file(tmp_path, fresh_helpers, monkeypatch):
    monkeypatch.setattr(output, "_digest", lambda *a: (0, "0" * 64))
    with pytest.raises(FileNotFoundError, match="data_9.tmp"):
        output._digest_saved(tmp_path / "data_9.tmp", False)
    (tmp_path / "x").write_bytes(b"abc")
    assert output._digest_saved(tmp_path / "x", False) == (3, hashlib.sha256(b"abc").hexdigest())


@contextlib.contextmanager
def _descriptors_above_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_with_descriptors_above_1024_the_digest_is_still_right(tmp_path, fresh_helpers):
    (tmp_path / "x").write_bytes(b"many")
    with _descriptors_above_1024(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert output._digest_saved(tmp_path / "x", False) == (4, hashlib.sha256(b"many").hexdigest())


def test_with_descriptors_above_1024_a_helper_still_starts(tmp_path, fresh_helpers):
    (tmp_path / "x").write_bytes(b"many")
    with _descriptors_above_1024(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert output._digest_saved(tmp_path / "x", False) == (4, hashlib.sha256(b"many").hexdigest())
        assert output._BUFFER.helper is not None


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_lets_go_of_the_helpers_pipes(tmp_path, fresh_helpers):
    helper = output._helper()
    pid = os.fork()
    if pid == 0:  # the child: its copies of the pipes are closed, and it may start its own helper
        try:
            closed = not helper.fds and not child._LIVE
            (tmp_path / "x").write_bytes(b"child")
            ok = output._digest_saved(tmp_path / "x", False) == (5, hashlib.sha256(b"child").hexdigest())
        finally:
            os._exit(0 if closed and ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert helper.proc.poll() is None and helper.fds  # the parent's helper is untouched
    (tmp_path / "y").write_bytes(b"parent")
    assert output._digest_saved(tmp_path / "y", False) == (6, hashlib.sha256(b"parent").hexdigest())


def test_a_slow_disk_bounds_the_backlog(tmp_path, monkeypatch):
    real = output.save_tensor_file
    waiting = []

    def slow(obj, path, fsync=False):
        time.sleep(0.02)
        return real(obj, path, fsync)

    monkeypatch.setattr(output, "save_tensor_file", slow)
    one = sample(64)
    per = sum(t.numel() * t.element_size() for t in one["hidden_states"])
    limit = 3 * per
    m = output.Manifest(tmp_path)
    m.start({"num_samples": 40, "start_idx": 0}, fsync=False)
    q = output.SaveQueue(m, workers=4, limit_bytes=limit, fsync=False)
    start = time.monotonic()
    for i in range(40):
        q.submit(i, output.data_name(i), sample(64, seed=i), 64, [1])
        waiting.append(q.peak_inflight)
    q.drain()
    assert q.peak_inflight <= limit, (q.peak_inflight, limit)
    assert time.monotonic() - start >= 40 * 0.02 / 3 * 0.9  # the loop did wait: 3 saves at a time
    assert len(output.Manifest.read(tmp_path).files) == 40
    unbounded = output.SaveQueue(output.Manifest(tmp_path / "u"), 4, limit_bytes=1 << 40, fsync=False)
    (tmp_path / "u").mkdir()
    unbounded._manifest.start({}, fsync=False)
    for i in range(40):
        unbounded.submit(i, output.data_name(i), sample(64, seed=i), 64, [1])
    with unbounded._cond:  # no save ends between the snapshot and drain's own (an RLock: drain re-enters it)
        left = unbounded._inflight, unbounded._pending
        unbounded.drain()
    assert unbounded.peak_inflight > limit  # the bound is what kept the first queue small
    # what drain waited for: the bytes and files still saving when it began, and its seconds
    assert unbounded.at_drain[:2] == left and left[1] > 0, (unbounded.at_drain, left)
    assert unbounded.at_drain[2] >= 0.02 * left[1] / 4 * 0.9, unbounded.at_drain


def test_a_failed_save_is_raised_with_its_cause(tmp_path, monkeypatch):
    calls = threading.Event()

    def full(obj, path, fsync=False):
        calls.set()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output, "save_tensor_file", full)
    m = output.Manifest(tmp_path)
    m.start({}, fsync=False)
    q = output.SaveQueue(m, workers=1, limit_bytes=1, fsync=False)
    with pytest.raises(RuntimeError, match="saving a data file failed: OSError: .*No space left on device"):
        for i in range(50):
            q.submit(i, output.data_name(i), sample(8), 8, [1])
        q.drain()
    assert calls.is_set() and output.Manifest.read(tmp_path).files == {}



def test_ctrl_c_in_drain_drops_the_saves_not_begun_and_a_second_drain_returns_at_once(tmp_path, monkeypatch, ctrl_c):
    real, started, release = output.save_tensor_file, [], threading.Event()

    def stuck(obj, path, fsync=False):
        started.append(path.name)
        release.wait(5)  # on the unfixed queue the second drain waits for this and the 3 others
        return real(obj, path, fsync)

    monkeypatch.setattr(output, "save_tensor_file", stuck)
    m = output.Manifest(tmp_path)
    m.start({}, fsync=False)
    q = output.SaveQueue(m, workers=1, limit_bytes=1 << 30, fsync=False)
    for i in range(4):
        q.submit(i, output.data_name(i), sample(8, seed=i), 8, [1])
    while not started:  # the first save has begun
        time.sleep(0.01)
    ctrl_c(0.3)
    with pytest.raises(KeyboardInterrupt):
        q.drain()
    t = time.monotonic()
    q.drain()
    assert time.monotonic() - t < 1
    release.set()
    q._pool.shutdown(wait=True)
    assert started == ["data_0.pt"]  # the one running finished; the three queued were dropped
    assert sorted(output.Manifest.read(tmp_path).files) == [0]
    assert (q._pending, q._inflight, sorted(q._live)) == (0, 0, [])  # the dropped ones let go of their samples

# -- the run's self-check: a sample captured twice must keep its rows ----------------------------


def _capture(rows: int = 12, seed: int = 3) -> dict:
    s = sample(rows, hidden=64, layers=3, seed=seed)
    s["hidden_states"][0][0] *= 40  # a massive first row, as trained models have
    return s


def _with(states_fn, base: dict) -> dict:
    return {"input_ids": base["input_ids"].clone(), "hidden_states": states_fn([h.clone() for h in base["hidden_states"]])}


def test_the_same_rows_pass_and_batch_noise_passes():
    ref = _capture()
    assert output.canary_error(ref, _with(lambda hs: hs, ref)) == (0.0, None)
    g = torch.Generator().manual_seed(9)
    def noise(hs):  # 1 % of each row's own scale, as bf16 batch-composition noise is
        return [(h.float() + 1e-2 * h.float().std(dim=-1, keepdim=True) * torch.randn(h.shape, generator=g)).to(h.dtype)
                for h in hs]

    noisy = _with(noise, ref)
    err, problem = output.canary_error(ref, noisy)
    assert problem is None and 0 < err < output.CANARY_TOLERANCE


def _swap(hs):
    hs[1][[3, 7]] = hs[1][[7, 3]]
    return hs


def _shift(hs):
    hs[2] = torch.roll(hs[2], 1, dims=0)
    return hs


def _zero(hs):
    hs[0][5] = 0
    return hs


@pytest.mark.parametrize("plant, where", [(_swap, "layer 1 row"), (_shift, "layer 2 row"), (_zero, "layer 0 row 5")])
def test_a_planted_misplacement_fails(plant, where):
    ref = _capture()
    err, problem = output.canary_error(ref, _with(plant, ref))
    assert problem and where in problem and err > output.CANARY_TOLERANCE, (err, problem)


def test_another_samples_rows_or_tokens_fail():
    ref = _capture()
    other = _capture(seed=4)
    assert output.canary_error(ref, other)[1].startswith("layer 0 row")
    shorter = {"input_ids": ref["input_ids"][:-1], "hidden_states": [h[:-1] for h in ref["hidden_states"]]}
    assert "token ids differ" in output.canary_error(ref, shorter)[1]
