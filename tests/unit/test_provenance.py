"""Provenance outside a git checkout: the GPU machine gets the work tree without .git. The tree
hash computed from the files must equal git's, and a changed file must make the result dirty."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_compat_testbed import provenance as prov

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _worktree_src_tree(tmp_path) -> str:
    """git's tree hash of the working tree's src/ (tracked + untracked, not ignored), through a
    scratch index: what HEAD:src will be once this is committed."""
    import os

    env = {**os.environ, "GIT_INDEX_FILE": str(tmp_path / "index")}
    subprocess.run(["git", "-C", str(ROOT), "add", "-A", "src"], env=env, check=True, capture_output=True)
    return subprocess.run(["git", "-C", str(ROOT), "write-tree", "--prefix=src/"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def head_copy(tmp_path):
    """The checkout's files without .git, as the device tool copies them; ``want`` = git's hash."""
    if not (ROOT / ".git").exists():
        pytest.fail("the unit tests run in a git checkout (provenance is bound to commits)")
    out = tmp_path / "copy"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z", "src", "testbed", "pyproject.toml",
                            "compat_matrix.yaml"], capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, out / f)
    return out


def test_tree_id_from_files_equals_git(head_copy, tmp_path):
    want = _worktree_src_tree(tmp_path)
    assert prov.tree_id(head_copy / "src") == want
    # a stray __pycache__ does not count (git ignores it)
    (head_copy / "src" / "speculators_compat" / "__pycache__").mkdir(exist_ok=True)
    (head_copy / "src" / "speculators_compat" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert prov.tree_id(head_copy / "src") == want
    # and a changed byte does
    target = head_copy / "src" / "speculators_compat" / "settings.py"
    target.write_text(target.read_text() + "#")
    assert prov.tree_id(head_copy / "src") != want


def _provenance_in(copy: Path) -> dict:
    code = "import json; from speculators_compat_testbed.provenance import provenance; print(json.dumps(provenance('t')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{copy / 'src'}:{copy / 'testbed'}"}, cwd=copy)
    return json.loads(out.stdout)


def test_copy_without_git_binds_to_the_stamped_commit_and_notices_a_change(head_copy, tmp_path):
    want = _worktree_src_tree(tmp_path)
    # no stamp: never bound to a commit
    p = _provenance_in(head_copy)
    assert p["commit"] is None and p["src_tree"] is None and ".checkout.json" in p["reason"]
    bed = prov.tree_id(head_copy / "testbed")
    (head_copy / prov.STAMP).write_text(json.dumps({
        "commit": _git("rev-parse", "HEAD"), "src_tree": want, "testbed_tree": bed,
        "matrix_sha256": None}))
    p = _provenance_in(head_copy)
    assert p["dirty"] is False and p["src_tree"] == want and p["src_tree_from"] == "files", p
    assert p["testbed_tree"] == bed, p
    # the copy's test bed ran (not the checkout's through an editable install)
    judge = head_copy / "testbed" / "speculators_compat_testbed" / "shrink.py"
    judge.write_text(judge.read_text() + "\n# edited on the device\n")
    p = _provenance_in(head_copy)
    assert p["dirty"] is True and p["src_tree"] == want and any("testbed/" in d for d in p["dirty_files"]), p
    judge.write_text(judge.read_text().replace("\n# edited on the device\n", ""))
    target = head_copy / "src" / "speculators_compat" / "settings.py"
    target.write_text(target.read_text() + "\n# edited on the device\n")
    p = _provenance_in(head_copy)
    assert p["dirty"] is True and p["src_tree"] != want, p
    shutil.rmtree(head_copy)


def _tiny_repo(path: Path) -> Path:
    """A git repo with src/a.py (plain) and src/run.sh (executable), committed."""
    import os

    (path / "src").mkdir(parents=True)
    (path / "src" / "a.py").write_text("x = 1\n")
    run = path / "src" / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(path), *args], env=env, check=True, capture_output=True)
    return path


def test_tree_id_takes_the_owner_execute_bit_as_git_does(tmp_path):
    repo = _tiny_repo(tmp_path / "r")
    want = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD:src"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert prov.tree_id(repo / "src") == want
    # group/other execute bits alone do not make git record 100755; the owner's does
    (repo / "src" / "a.py").chmod(0o654)
    assert prov.tree_id(repo / "src") == want
    (repo / "src" / "a.py").chmod(0o744)
    assert prov.tree_id(repo / "src") != want


def test_stamp_describes_the_root_it_is_given(tmp_path):
    repo = _tiny_repo(tmp_path / "r")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    written = json.loads(prov.stamp(repo).read_text())
    assert written["commit"] == head  # not this checkout's HEAD
    assert written["src_tree"] == prov.tree_id(repo / "src")
    (repo / "src" / "a.py").write_text("x = 2\n")
    with pytest.raises(RuntimeError, match="refusing to stamp"):
        prov.stamp(repo)


def test_scrub_paths_after_an_escaped_newline(tmp_path):
    """A traceback stored through repr() joins lines with a literal backslash-n; the path after
    it is a machine path all the same (two arch JSONs kept one), and it ends at the next escape."""
    s = "/"
    root = tmp_path / "checkout"
    text = ("warning\\n" + s + "work/x/.bed/envs/spec-0.4.0.1_vllm-0.32.0/lib/python3.12/site-packages/vllm/a.py"
            "\\n  next line\\t" + s + "tmp/out.json")
    out = prov.scrub_paths(text, root)
    assert s + "work/" not in out and s + "tmp/" not in out, out
    assert "<env>/site-packages/vllm/a.py\\n  next line" in out, out
    # a path inside a word is not a machine path (a/work/b), nor is an escape alone
    assert prov.scrub_paths("a" + s + "work/b", root) == "a" + s + "work/b"
    assert prov.scrub_paths("a\\nb", root) == "a\\nb"


def test_a_stamp_of_a_commit_the_copys_git_lacks_binds_to_the_stamp(tmp_path):
    # the device's copy: the work tree of a newer commit over an older .git
    repo = _tiny_repo(tmp_path / "r")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    want = prov.tree_id(repo / "src")
    (repo / prov.STAMP).write_text(json.dumps({"commit": head, "src_tree": want}))
    p = prov.provenance("t", root=repo)
    assert p["commit"] == head and p["dirty"] is False and "src_tree_from" not in p, p
    (repo / prov.STAMP).write_text(json.dumps({"commit": "f" * 40, "src_tree": want}))
    p = prov.provenance("t", root=repo)
    assert p["commit"] == "f" * 40 and p["src_tree"] == want and p["src_tree_from"] == "files", p
    assert p["dirty"] is False, p
    # stamping again describes git's HEAD, not the stamp it replaces
    assert json.loads(prov.stamp(repo).read_text())["commit"] == head
    (repo / prov.STAMP).write_text(json.dumps({"commit": "f" * 40, "src_tree": want}))
    (repo / "src" / "a.py").write_text("x = 2\n")
    p = prov.provenance("t", root=repo)
    assert p["commit"] == "f" * 40 and p["dirty"] is True and p["src_tree"] != want, p
