"""speculators' released ``data_generation_offline.py`` under ``speculators-compat run``, killed
with SIGKILL (its whole process group: script, engine, workers) at several points and re-run
with the same command: the folder must end as an uninterrupted run's, file for file and byte for
byte, with a manifest ``verify`` accepts. Also: planted damage (a truncated and a deleted data
file, a torn manifest line) is recomputed; another run's settings and an unmanifested folder are
refused in one line; ``verify`` names truncation, deletion, a flipped byte and a foreign file.
Each kill lands at a chosen point whatever the CPU load: a planted ``sitecustomize`` stops the
process that reaches it (SIGSTOP) and leaves a marker, and the test then kills the group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm")
pytest.importorskip("speculators")

import script_pipeline as sp  # noqa: E402

from speculators_compat import output  # noqa: E402

BATCH = 2
ROWS = 14  # 7 batches: kills land between and inside batches
CANARY_EVERY = 3  # sample 0 joins batches 2 and 5 again (the run's self-check)


def rows() -> list[dict]:
    base = sp.chat_rows()
    out = []
    for i in range(ROWS):
        r = json.loads(json.dumps(base[i % len(base)]))
        turn = r["conversations"][-1]
        key = "value" if "value" in turn else "content"
        turn[key] = f"{turn[key]} (sample {i})"
        out.append(r)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return {"work": work, "data": data, "model": sp.tiny_chat_model(),
            "script": sp.script_for(sp.installed_speculators())}


def command(setup, out: Path, layer_ids=sp.LAYER_IDS, work: Path | None = None) -> list[str]:
    args = sp.script_args(setup["model"], setup["data"], out, work or setup["work"])
    i = args.index("--batch-size")
    args[i + 1] = str(BATCH)
    j = args.index("--layer-ids")
    args[j + 1:j + 1 + len(sp.LAYER_IDS)] = [str(x) for x in layer_ids]
    return [sys.executable, "-m", "speculators_compat", "run", sys.executable, str(setup["script"]), *args]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ, **(extra or {}))
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e["HF_HUB_OFFLINE"] = e["HF_DATASETS_OFFLINE"] = "1"
    e["SPECULATORS_COMPAT_SELF_CHECK_EVERY"] = str(CANARY_EVERY)
    return e


# planted in every process of a run that is to be killed (sitecustomize: the shim's boot runs it
# next, and it is the chain's last link, as in the beds, which have no sitecustomize of their own): the
# process reaching the point SPECULATORS_COMPAT_TEST_FREEZE names writes the marker file, then stops
# itself, so nothing after that point happens before the test's SIGKILL ("files:K": once the
# manifest records K intact files; "preprocess": at the first write of a datasets cache)
FREEZE = """
import os
import signal

_point = os.environ.get("SPECULATORS_COMPAT_TEST_FREEZE", "")


def _freeze():
    open(os.environ["SPECULATORS_COMPAT_TEST_FREEZE_MARKER"], "w").close()
    os.kill(os.getpid(), signal.SIGSTOP)


def _intact(folder, records):
    return sum(1 for r in records if os.path.isfile(os.path.join(folder, r["file"]))
               and os.path.getsize(os.path.join(folder, r["file"])) == r["bytes"])


if _point.startswith("files:"):
    import speculators_compat.output as _output

    _append = _output.Manifest.append

    def append(self, record):
        _append(self, record)
        if "file" in record and _intact(self.folder, list(self.files.values())) >= int(_point[len("files:"):]):
            _freeze()

    _output.Manifest.append = append
elif _point == "preprocess":
    import datasets.arrow_writer as _aw

    def _frozen_after(name):
        original = getattr(_aw.ArrowWriter, name)

        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _freeze()
            return result

        setattr(_aw.ArrowWriter, name, wrapper)

    for _name in ("write", "write_batch", "write_table"):
        _frozen_after(_name)
"""


def run(setup, out: Path, freeze_at: str | None = None, timeout: float = 900, **kw) -> dict:
    """Run the script (its output to a file: a full pipe cannot stall it); with ``freeze_at`` (see
    FREEZE), SIGKILL its process group once a process of it stopped there, or at the timeout."""
    start = time.monotonic()
    extra_env = kw.pop("extra_env", None)
    marker = None
    if freeze_at is not None:
        plant = setup["work"] / "freeze"
        plant.mkdir(exist_ok=True)
        (plant / "sitecustomize.py").write_text(FREEZE)
        marker = plant / f"frozen-{time.monotonic_ns()}"
        path = os.pathsep.join(p for p in (str(plant), os.environ.get("PYTHONPATH", "")) if p)
        extra_env = {**(extra_env or {}), "PYTHONPATH": path, "SPECULATORS_COMPAT_TEST_FREEZE": freeze_at,
                     "SPECULATORS_COMPAT_TEST_FREEZE_MARKER": str(marker)}
    log = setup["work"] / f"run-{time.monotonic_ns()}.log"
    killed = False
    with open(log, "w") as sink:
        proc = subprocess.Popen(command(setup, out, **kw), cwd=kw.get("work") or setup["work"], env=env(extra_env),
                                start_new_session=True, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and time.monotonic() - start < timeout:
                if marker is not None and marker.exists():
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.02)
        finally:
            if proc.poll() is None:  # frozen short of its marker, or past the timeout: nothing left behind
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    if killed:
        try:  # workers of the killed group must be gone before the next run starts its own
            os.killpg(proc.pid, 0)
            time.sleep(1)
        except ProcessLookupError:
            pass
    return {"rc": proc.returncode, "killed": killed, "log": log.read_text(errors="replace"),
            "seconds": time.monotonic() - start}


def recorded(out: Path) -> int:
    return len(output.Manifest.read(out).files) if (out / output.MANIFEST).exists() else 0


def intact(out: Path) -> int:
    """Recorded files that are there in full (the planted damage below leaves two that are not)."""
    if not (out / output.MANIFEST).exists():
        return 0
    files = output.Manifest.read(out).files.values()
    return sum(1 for r in files if (out / r["file"]).is_file() and (out / r["file"]).stat().st_size == r["bytes"])


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("data_*.pt"))}


@pytest.fixture(scope="module")
def reference(setup):
    out = setup["work"] / "uninterrupted"
    r = run(setup, out)
    assert r["rc"] == 0, r["log"][-4000:]
    assert sorted(contents(out)) == sorted(f"data_{i}.pt" for i in range(ROWS))
    checks = output.Manifest.read(out).self_checks
    canary = [c for c in checks if c.get("kind") != "engine"]
    engine = [c for c in checks if c.get("kind") == "engine"]
    assert [c["batch"] for c in canary] == [2, 5] and all(c["verdict"] == "pass" for c in canary), checks
    # the engine self-check of every call, its tally beside the data
    assert len(engine) == 1 and engine[0]["calls"] == 7 and engine[0]["rows"] > 0, engine
    assert engine[0]["tokens_checked"] > 0 and engine[0]["final_rows"] > 0 and not engine[0]["not_covered"], engine
    print(f"\nself-check of the uninterrupted run: {checks}")
    return out


def test_killed_at_every_stage_resumes_to_the_uninterrupted_files(setup, reference):
    out = setup["work"] / "killed"
    work = setup["work"] / "killed-work"  # its own datasets cache: preprocessing runs anew
    work.mkdir()
    stages = []

    def stage(name, **kw):
        r = run(setup, out, work=work, **kw)
        assert r["killed"], f"{name}: the run was not stopped where aimed (exit {r['rc']}):\n{r['log'][-3000:]}"
        assert "Error in sitecustomize" not in r["log"], r["log"][-3000:]  # the plant loaded, once
        stages.append((name, r, intact(out)))
        return r

    # 1. during preprocessing: a datasets cache file half-written, no output folder yet
    stage("preprocessing", freeze_at="preprocess")
    assert not out.exists(), "the preprocessing kill landed after the output folder was made"
    # 2. and 3. during extraction and saving: once 3, then 8 files are recorded
    for k in (3, 8):
        stage(f"after {k} files", freeze_at=f"files:{k}")
    # planted damage, as a power loss leaves it: a truncated file, a lost one, a torn manifest line
    files = output.Manifest.read(out).files
    victims = sorted(files)[:2]
    torn = out / output.data_name(victims[0])
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    (out / output.data_name(victims[1])).unlink()
    with open(out / output.MANIFEST, "ab") as f:
        f.write(b'{"file": "data_99.pt", "index": 99, "tok')
    # 4. during the final writes: the moment every file is recorded intact (the two damaged redone)
    stage("final writes", freeze_at=f"files:{ROWS}")
    # 5. the same command once more, to the end
    r = run(setup, out, work=work)
    stages.append(("to the end", r, intact(out)))
    report = [(name, x["rc"], x["killed"], n, round(x["seconds"], 1)) for name, x, n in stages]
    print("\nstages (name, exit, killed, files intact after, s):", report)
    # each extraction kill left at least the files it was aimed at (another save thread may record
    # one before the stop lands: 4 at k = 3 once), the run unfinished; the last every file intact
    assert 3 <= stages[1][2] < 8 <= stages[2][2] < ROWS == stages[3][2], report
    assert r["rc"] == 0, r["log"][-4000:]
    assert contents(out) == contents(reference), "a resumed file differs from the uninterrupted run's"
    for name in ("sample_lengths.json",) if (reference / "sample_lengths.json").exists() else ():
        assert json.loads((out / name).read_text()) == json.loads((reference / name).read_text())
    assert (out / "data_config.json").exists()
    summary, defects = output.verify(out)
    assert defects == [] and summary["complete"], [str(d) for d in defects]
    assert not list(out.glob(".speculators_compat.*")), "temporary files left behind"
    checks = output.Manifest.read(out).self_checks
    assert checks and all(c["verdict"] == "pass" for c in checks), checks


def test_resumed_files_hold_the_same_tensors(reference, setup):
    """Bytes equal implies tensors equal; this reads them back as speculators' trainer does."""
    import torch

    out = setup["work"] / "killed"
    if not (out / output.MANIFEST).exists():
        pytest.skip("the kill test did not run")
    for name in sorted(contents(reference)):
        a, b = torch.load(reference / name, weights_only=True), torch.load(out / name, weights_only=True)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(torch.as_tensor(a["loss_mask"]),
                                                                           torch.as_tensor(b["loss_mask"]))
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)), name


def test_a_finished_folder_is_not_recomputed(setup, reference):
    out = setup["work"] / "finished"
    shutil.copytree(reference, out)
    (out / "data_config.json").unlink()  # as a kill just before the last write leaves it
    (out / "sample_lengths.json").unlink(missing_ok=True)
    r = run(setup, out)
    assert r["rc"] == 0, r["log"][-3000:]
    assert "All samples already processed!" in r["log"] and "Initializing vLLM" not in r["log"], r["log"][-2000:]
    assert contents(out) == contents(reference)
    assert json.loads((out / "data_config.json").read_text()) == json.loads((reference / "data_config.json").read_text())
    assert output.verify(out)[1] == []


def one_line_refusal(r: dict) -> str:
    lines = [ln for ln in r["log"].splitlines() if ln.startswith("speculators-compat: ")]
    assert r["rc"] == 1 and len(lines) == 1 and "Traceback" not in r["log"], r["log"][-3000:]
    return lines[0]


def test_other_layers_are_refused_in_one_line(setup, reference):
    out = setup["work"] / "other-layers"
    shutil.copytree(reference, out)
    before = contents(out)
    line = one_line_refusal(run(setup, out, layer_ids=[1, 2, 3, 3]))
    assert "layer_ids: expected [0, 1, 2, 3]" in line and "found [1, 2, 3, 3]" in line, line
    assert contents(out) == before


def test_a_folder_without_manifest_is_refused(setup, reference):
    out = setup["work"] / "unmanifested"
    out.mkdir()
    shutil.copy(reference / "data_0.pt", out / "data_0.pt")
    line = one_line_refusal(run(setup, out))
    assert "no speculators_compat_manifest.jsonl" in line and "SPECULATORS_COMPAT_OUTPUT_RESUME=restart" in line


def verify_cli(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speculators_compat", "verify", str(folder), *extra],
                          capture_output=True, text=True, timeout=120)


def test_verify_names_each_planted_defect(setup, reference):
    ok = verify_cli(reference)
    assert ok.returncode == 0 and ": ok" in ok.stdout, ok.stdout + ok.stderr
    bad = setup["work"] / "damaged"
    shutil.copytree(reference, bad)
    p = bad / "data_1.pt"
    p.write_bytes(p.read_bytes()[:-100])  # truncated
    (bad / "data_2.pt").unlink()  # deleted
    p = bad / "data_3.pt"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF  # same size, one byte flipped
    p.write_bytes(bytes(b))
    shutil.copy(bad / "data_0.pt", bad / f"data_{ROWS + 5}.pt")  # foreign
    r = verify_cli(bad, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    found = {(d["kind"], d["name"]) for d in json.loads(r.stdout)["defects"]}
    assert {("truncated", "data_1.pt"), ("missing", "data_2.pt"), ("checksum", "data_3.pt"),
            ("foreign", f"data_{ROWS + 5}.pt")} <= found, found
    quick = verify_cli(bad, "--quick", "--json")  # sizes only: the flipped byte passes, the rest not
    kinds = {(d["kind"], d["name"]) for d in json.loads(quick.stdout)["defects"]}
    assert quick.returncode == 1 and ("checksum", "data_3.pt") not in kinds and ("truncated", "data_1.pt") in kinds
    none = verify_cli(setup["work"])
    assert none.returncode == 2 and "no readable speculators_compat_manifest.jsonl" in none.stderr


# planted in every process of the run (sitecustomize): a worker's step places its last request's
# rows one row early (an off-by-one in the batch layout: counts stay right, rows are wrong)
PLANT = """
import speculators_compat.extraction.capture as _capture

_compute_spans = _capture.CaptureState.compute_spans


def compute_spans(self):
    spans = _compute_spans(self)
    if len(spans) > 1:
        src, rid, dst, n = spans[-1]
        spans[-1] = (src - 1, rid, dst, n)
    return spans


_capture.CaptureState.compute_spans = compute_spans
"""


def test_the_self_check_stops_a_run_whose_rows_are_misplaced(setup, reference, tmp_path):
    """The canary alone (the engine self-check off): sample 0 is first in batch 0 (rows right) and
    last when it joins batch 2 again (rows one early): the run must stop there in one line, the
    manifest saying so and ``verify`` refusing it."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    out = setup["work"] / "planted"
    path = os.pathsep.join(p for p in (str(plant), os.environ.get("PYTHONPATH", "")) if p)
    r = run(setup, out, extra_env={"PYTHONPATH": path, "SPECULATORS_COMPAT_SELF_CHECK_ROWS": "0"})
    assert r["rc"] != 0, r["log"][-3000:]
    lines = [ln for ln in r["log"].splitlines() if "speculators-compat self-check failed" in ln]
    assert lines and "sample 0, captured again in batch 2" in lines[0], r["log"][-3000:]
    checks = output.Manifest.read(out).self_checks
    assert [c["verdict"] for c in checks] == ["fail"] and checks[0]["batch"] == 2, checks
    assert checks[0]["max_rel_error"] > output.CANARY_TOLERANCE
    summary, defects = output.verify(out)
    assert any(d.kind == "self-check" for d in defects), [str(d) for d in defects]
    # the planted layout wrote wrong rows that the uninterrupted run did not: the check is not vacuous
    assert contents(out)["data_1.pt"] != contents(reference)["data_1.pt"]
    assert contents(out)["data_0.pt"] == contents(reference)["data_0.pt"]  # first in its step: untouched
    print(f"\nplanted misplacement: {lines[0][:300]}")


def test_the_engine_self_check_stops_the_same_misplacement_in_its_first_batch(setup, tmp_path):
    """The same planted layout with the engine self-check on (the default): batch 0 already holds a
    row computed for another token, so the run stops there, the manifest and ``verify`` saying so."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    out = setup["work"] / "planted-engine"
    path = os.pathsep.join(p for p in (str(plant), os.environ.get("PYTHONPATH", "")) if p)
    r = run(setup, out, extra_env={"PYTHONPATH": path})
    assert r["rc"] != 0, r["log"][-3000:]
    lines = [ln for ln in r["log"].splitlines() if "speculators-compat self-check failed" in ln]
    assert lines and "another sequence's token" in lines[0], r["log"][-3000:]
    checks = output.Manifest.read(out).self_checks
    assert [(c.get("kind"), c["verdict"], c["batch"], c["sample"]) for c in checks] == [("engine", "fail", 0, 0)], checks
    assert recorded(out) == 0, "a file of the failed batch was recorded"
    _summary, defects = output.verify(out)
    assert any(d.kind == "self-check" for d in defects), [str(d) for d in defects]
    print(f"\nplanted misplacement, engine self-check: {lines[0][:300]}")
