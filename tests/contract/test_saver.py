"""The saver process with real torch and a real exchange pool: samples in shared memory are written
outside the driver, byte for byte as the driver would write them; whatever it cannot take, a lost
or unstartable saver, and a dead driver cost speed or a clear error, never a file."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from speculators_compat import output, saver  # noqa: E402
from speculators_compat.exchange import ExchangePool  # noqa: E402

ROWS, HIDDEN, LAYERS = 300, 128, 3


def _shared_sample(pool: ExchangePool, seed: int) -> tuple[dict, dict]:
    """(a sample whose hidden states are result tensors in the exchange, as the generator hands
    them; an independent copy of it)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = ROWS * HIDDEN * 2
    placements, _, _ = pool.allocate_runs([[((seed, k), nbytes)] for k in range(LAYERS)])
    states = []
    for k in range(LAYERS):
        t = torch.frombuffer(pool.lease_view(placements[(seed, k)], nbytes), dtype=torch.bfloat16).view(ROWS, HIDDEN)
        t.copy_(torch.randn(ROWS, HIDDEN, generator=g) * (1 + 50 * (k == 0)))
        states.append(t)
    mask = torch.randint(0, 2, (2 * ROWS,), generator=g)  # a slice of a longer mask, as the script saves
    obj = {"input_ids": torch.randint(0, 1000, (ROWS,), generator=g), "hidden_states": states,
           "loss_mask": mask[:ROWS]}
    copy = {"input_ids": obj["input_ids"].clone(), "hidden_states": [t.clone() for t in states],
            "loss_mask": mask.clone()[:ROWS]}
    return obj, copy


def _queue(folder: Path, pool, workers: int = 2, limit: int = 1 << 30) -> output.SaveQueue:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = output.Manifest(folder)
    manifest.start({"format": output.FORMAT}, False)
    return output.SaveQueue(manifest, workers, limit, False, shared=lambda: pool)


def _check_folder(folder: Path, copies: dict, exact: bool = True) -> None:
    """Every file loads back equal to its sample, and its manifest line holds its size and SHA-256."""
    records = output.Manifest.read(folder).files
    assert sorted(records) == sorted(copies) if exact else set(copies) <= set(records)
    for index, copy in copies.items():
        path = folder / output.data_name(index)
        data = path.read_bytes()
        assert (records[index]["bytes"], records[index]["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        got = torch.load(path)
        assert torch.equal(got["input_ids"], copy["input_ids"])
        assert torch.equal(got["loss_mask"], copy["loss_mask"])
        assert len(got["hidden_states"]) == LAYERS
        for a, b in zip(got["hidden_states"], copy["hidden_states"]):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def _fill(queue, pool, n: int, first: int = 0) -> dict:
    copies = {}
    for index in range(first, first + n):
        obj, copies[index] = _shared_sample(pool, index)
        queue.submit(index, output.data_name(index), obj, ROWS, [1, 2, 3])
        del obj
    return copies


def test_exchange_samples_are_written_by_the_saver_byte_for_byte_as_here(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copies = _fill(queue, pool, 6)
        queue.drain()
    assert (queue.saved, queue.saved_by_saver, queue.saver_failure) == (6, 6, None)
    _check_folder(tmp_path / "out", copies)
    assert pool.leased == 0  # every exchange segment went back once its file was written
    (tmp_path / "here").mkdir()
    for index, copy in copies.items():  # the driver's own save of the same sample: the same bytes
        size, sha = output.save_tensor_file(copy, tmp_path / "here" / output.data_name(index))
        assert sha == output.Manifest.read(tmp_path / "out").files[index]["sha256"]


def test_what_travels_is_a_description_not_the_rows(tmp_path):
    pool = ExchangePool()
    obj, _copy = _shared_sample(pool, 1)
    described = saver.describe(obj, pool.locate)
    size = len(pickle.dumps(described))
    assert size < 3 * ROWS * 8 + 2048  # ids and mask as bytes; the 3 x 300 x 128 bf16 rows not at all
    for t in described["hidden_states"]:
        assert isinstance(t, saver._T) and isinstance(t[1], tuple)  # (fd, dev, ino, size) of a chunk
    outside = {"hidden_states": [torch.zeros(saver.INLINE_MAX // 4 + 1)]}  # large and outside the exchange
    assert saver.describe(outside, pool.locate) is None
    assert saver.describe({"hidden_states": [torch.zeros(2, requires_grad=True)]}, pool.locate) is None


def test_shared_storages_views_and_empty_tensors_give_the_drivers_bytes(tmp_path):
    """A layer id asked twice (one tensor twice), a transposed view, a slice of a shared tensor, an
    empty tensor, nested containers: the saver's file is the driver's torch.save byte for byte."""
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    obj, _ = _shared_sample(pool, 4)
    hs = obj["hidden_states"]
    ids = torch.arange(50)
    tricky = {"input_ids": ids, "hidden_states": [hs[0], hs[1], hs[0], hs[2].t(), hs[1][10:20]],
              "loss_mask": ids[5:9], "extra": (torch.empty(0, 7), [None, 3, "x"])}
    queue.submit(0, output.data_name(0), tricky, ROWS, [1])
    queue.drain()
    assert queue.saved_by_saver == 1
    (tmp_path / "here").mkdir()
    size, sha = output.save_tensor_file(tricky, tmp_path / "here" / output.data_name(0))
    assert sha == output.Manifest.read(tmp_path / "out").files[0]["sha256"]
    got = torch.load(tmp_path / "out" / output.data_name(0))
    assert got["hidden_states"][0].data_ptr() == got["hidden_states"][2].data_ptr()
    assert torch.equal(got["hidden_states"][3], hs[2].t()) and got["extra"][1] == [None, 3, "x"]


def test_a_sample_outside_the_exchange_is_saved_here(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    big = torch.randn(saver.INLINE_MAX // 2 + 1, 2).to(torch.bfloat16)
    queue.submit(0, output.data_name(0), {"input_ids": torch.arange(3), "hidden_states": [big],
                                          "loss_mask": torch.ones(3)}, 3, [1])
    copies = _fill(queue, pool, 2, first=1)
    queue.drain()
    assert (queue.saved, queue.saved_by_saver) == (3, 2)
    assert torch.equal(torch.load(tmp_path / "out" / output.data_name(0))["hidden_states"][0], big)
    _check_folder(tmp_path / "out", copies, exact=False)


def test_a_saver_killed_mid_run_costs_nothing_but_speed(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    with pytest.warns(RuntimeWarning, match="written by this process"):
        copies = _fill(queue, pool, 3)
        os.kill(queue._saver.proc.pid, signal.SIGKILL)
        copies.update(_fill(queue, pool, 4, first=3))
        queue.drain()
    assert queue.saved == 7 and queue.saver_failure and queue.saved_by_saver < 7
    _check_folder(tmp_path / "out", copies)
    assert pool.leased == 0


@pytest.mark.parametrize("program", ["/bin/false", "/nonexistent/python"])
def test_a_saver_that_cannot_start_leaves_the_saves_here_with_one_warning(tmp_path, monkeypatch, program):
    monkeypatch.setattr(sys, "executable", program)
    pool = ExchangePool()
    with pytest.warns(RuntimeWarning, match="written by this process") as caught:
        queue = _queue(tmp_path / "out", pool)
        copies = _fill(queue, pool, 3)
        queue.drain()
    assert len([w for w in caught if "written by this process" in str(w.message)]) == 1
    assert (queue.saved, queue.saved_by_saver) == (3, 0)
    _check_folder(tmp_path / "out", copies)


def test_a_chunk_the_saver_cannot_open_as_described_is_saved_here(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)

    class Misdescribed:  # the chunk's descriptor, with an inode that is not the file's
        def locate(self, ptr, nbytes):
            place = pool.locate(ptr, nbytes)
            return None if place is None else ((place[0][0], place[0][1], place[0][2] + 1, place[0][3]), place[1])

    queue._shared = lambda: Misdescribed()
    with pytest.warns(RuntimeWarning, match="not the exchange chunk"):
        copies = _fill(queue, pool, 3)
        queue.drain()
    assert (queue.saved, queue.saved_by_saver) == (3, 0)
    _check_folder(tmp_path / "out", copies)



def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_ctrl_c_in_drain_ends_the_saver_unwarned_and_a_second_drain_returns_at_once(tmp_path, ctrl_c):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    assert queue._saver.ready.wait(saver.READY_S)
    pid = queue._saver.proc.pid
    os.kill(pid, signal.SIGSTOP)  # a saver that answers nothing: drain waits until interrupted
    threading.Timer(5, _continue, (pid,)).start()  # the unfixed queue waits for it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fill(queue, pool, 3)
        ctrl_c(0.3)
        with pytest.raises(KeyboardInterrupt):
            queue.drain()
        t = time.monotonic()
        queue.drain()
    assert time.monotonic() - t < 1
    assert queue._saver.proc.poll() is not None and queue.saver_failure == "interrupted"
    assert queue.saved == 0 and not list((tmp_path / "out").glob("*.pt")) and pool.leased == 0

def test_a_save_error_in_the_saver_is_raised_with_its_cause(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    obj, _ = _shared_sample(pool, 0)
    queue.submit(0, "no_such_folder/data_0.pt", obj, ROWS, [1])
    del obj
    with pytest.raises(RuntimeError, match=r"saving a data file failed: .*No such file or directory") as info:
        queue.drain()
    assert isinstance(info.value.__cause__, OSError)
    assert not list((tmp_path / "out").glob("*.pt")) and pool.leased == 0


PREAMBLE = """
    import os, signal, sys, time, torch
    from pathlib import Path
    from speculators_compat import output
    from speculators_compat.exchange import ExchangePool
    pool, folder = ExchangePool(), Path(sys.argv[1])
    folder.mkdir()
    m = output.Manifest(folder)
    m.start({"format": output.FORMAT}, False)
"""
DRIVER = textwrap.dedent(PREAMBLE + """
    q = output.SaveQueue(m, 2, 1 << 30, False, shared=lambda: pool)
    time.sleep(0.5)
    print(q._saver.proc.pid, flush=True)
    time.sleep(600)
""")


def _driver(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    """(a driver process running ``code``, the pid of its saver, which it prints)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(output.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    driver = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, env=env)
    return driver, int(driver.stdout.readline())


def _ended_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` ends (or is a zombie: its parent was the driver) within ``seconds``; killed if not."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def test_the_saver_ends_when_its_driver_is_killed(tmp_path):
    driver, pid = _driver(DRIVER, str(tmp_path / "out"))
    os.kill(pid, 0)  # the saver runs
    driver.kill()
    driver.wait()
    assert _ended_within(pid, 30), "the saver outlived its driver by 30 s"


def _drain_within(queue, seconds: float = 60) -> None:
    """``queue.drain()``, failing (not hanging) where it does not return in ``seconds``."""
    import threading

    outcome: list = []

    def run():
        try:
            queue.drain()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert outcome, f"drain did not return in {seconds} s (pending {queue._pending}, with the saver {sorted(queue._sent)})"
    if outcome[0] is not None:
        raise outcome[0]


Pair = collections.namedtuple("Pair", "a b")


def test_what_cannot_be_described_is_saved_here_and_drain_returns(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    obj, copy = _shared_sample(pool, 0)
    obj["extra"] = Pair(torch.arange(3), 2)
    queue.submit(0, output.data_name(0), obj, ROWS, [1])
    del obj
    copies = _fill(queue, pool, 2, first=1)
    _drain_within(queue)
    assert (queue.saved, queue.saved_by_saver) == (3, 2)
    assert torch.load(tmp_path / "out" / output.data_name(0), weights_only=False)["extra"].b == 2
    _check_folder(tmp_path / "out", copies, exact=False)


def test_under_warnings_as_errors_a_lost_saver_still_loses_no_sample(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        copies = _fill(queue, pool, 3)
        os.kill(queue._saver.proc.pid, signal.SIGKILL)
        copies.update(_fill(queue, pool, 2, first=3))
        _drain_within(queue)
    assert queue.saved == 5 and queue.saver_failure
    _check_folder(tmp_path / "out", copies)
    assert pool.leased == 0


def test_an_interrupt_mid_send_neither_hangs_nor_records_a_wrong_file(tmp_path, monkeypatch):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    copies = _fill(queue, pool, 2)
    real, calls = saver._write_frame, []

    def cut_short(fd, payload):  # half a frame, then Ctrl-C
        calls.append(1)
        if len(calls) == 1:
            os.write(fd, struct.pack("<Q", len(payload)) + payload[: len(payload) // 2])
            raise KeyboardInterrupt
        real(fd, payload)

    monkeypatch.setattr(saver, "_write_frame", cut_short)
    obj, cut = _shared_sample(pool, 2)
    with pytest.raises(KeyboardInterrupt):
        queue.submit(2, output.data_name(2), obj, ROWS, [1])
    del obj
    copies.update(_fill(queue, pool, 2, first=3))
    _drain_within(queue)
    records = output.Manifest.read(tmp_path / "out").files
    if 2 in records:  # saved by the threads here once the stopped saver gave it back
        copies[2] = cut
    _check_folder(tmp_path / "out", copies)
    assert queue.saver_failure and pool.leased == 0


KILLED = textwrap.dedent(PREAMBLE + """
    q = output.SaveQueue(m, 2, 1 << 33, False, shared=lambda: pool)
    keep = []
    for i in range(8):  # a chunk each, the first ones mapped and saving when this process dies
        placements, _, _ = pool.allocate({0: 48 << 20})
        t = torch.frombuffer(pool.lease_view(placements[0], 48 << 20), dtype=torch.bfloat16)
        t.normal_()
        keep.append(t)
    print(q._saver.proc.pid, flush=True)
    time.sleep(float(sys.argv[2]))  # the saver has started
    for i, t in enumerate(keep):
        q.submit(i, output.data_name(i), {"input_ids": torch.arange(4), "hidden_states": [t]}, 4, [1])
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_after_its_driver_is_killed_the_saver_places_no_file(tmp_path):
    folder = tmp_path / "out"
    driver, pid = _driver(KILLED, str(folder), "8")
    driver.wait()
    placed = set(output.data_files(folder))
    assert _ended_within(pid, 60), "the saver outlived its driver by 60 s"
    assert set(output.data_files(folder)) == placed  # nothing renamed after the driver went
    recorded = output.Manifest.read(folder).files
    for index in placed & set(recorded):
        data = (folder / output.data_name(index)).read_bytes()
        assert hashlib.sha256(data).hexdigest() == recorded[index]["sha256"]


def test_a_relative_output_folder_gets_its_files_placed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool = ExchangePool()
    queue = _queue(Path("out"), pool)
    copies = _fill(queue, pool, 3)  # the saver is told absolute paths; the driver places them there
    _drain_within(queue)
    assert (queue.saved, queue.saved_by_saver, queue.saver_failure) == (3, 3, None)
    _check_folder(tmp_path / "out", copies)


def test_a_saver_that_dies_idle_is_said_once_and_the_threads_save(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)
    assert queue._saver.ready.wait(120)
    with pytest.warns(RuntimeWarning, match="written by this process"):
        os.kill(queue._saver.proc.pid, signal.SIGKILL)
        queue._saver._reader.join(30)
    assert queue.saver_failure
    copies = _fill(queue, pool, 2)
    _drain_within(queue)
    assert (queue.saved, queue.saved_by_saver) == (2, 0)
    _check_folder(tmp_path / "out", copies)


def test_a_fault_in_describing_is_said_once_and_the_threads_save(tmp_path):
    pool = ExchangePool()
    queue = _queue(tmp_path / "out", pool)

    class Broken:
        def locate(self, ptr, nbytes):
            raise AttributeError("no such thing")

    queue._shared = lambda: Broken()
    with pytest.warns(RuntimeWarning, match="describing a sample failed: AttributeError"):
        copies = _fill(queue, pool, 2)
    _drain_within(queue)
    assert (queue.saved, queue.saved_by_saver) == (2, 0)
    _check_folder(tmp_path / "out", copies)


@pytest.mark.parametrize("queued", [True, False])
def test_an_interrupt_in_handing_a_sample_to_the_threads_never_hangs_drain(tmp_path, queued):
    pool = ExchangePool()
    folder = tmp_path / "out"
    folder.mkdir()
    manifest = output.Manifest(folder)
    manifest.start({"format": output.FORMAT}, False)
    queue = output.SaveQueue(manifest, 2, 1 << 30, False)
    real = queue._pool.submit

    def interrupted(*args):
        if queued:
            real(*args)
        raise KeyboardInterrupt

    queue._pool.submit = interrupted
    obj, copy = _shared_sample(pool, 0)
    with pytest.raises(KeyboardInterrupt):
        queue.submit(0, output.data_name(0), obj, ROWS, [1])
    queue._pool.submit = real
    del obj
    _drain_within(queue)
    assert queue._pending == 0 and queue._inflight == 0 and pool.leased == 0
    if 0 in output.Manifest.read(folder).files:
        _check_folder(folder, {0: copy})
