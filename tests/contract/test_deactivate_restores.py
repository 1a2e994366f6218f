"""After ``deactivate()`` nothing of the shim is left in vLLM, speculators or transformers: every
module attribute and every attribute of their classes is again what it was (no wrapper, function,
class or stand-in module of ``speculators_compat``), ``sys.modules`` holds no stand-in, and the
environment's shim and vLLM settings are as before. Run in a fresh interpreter on the real installed releases, after every
patch that this pair gates in has applied; a control leaves one patch applied and must be found.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")

SCAN = r'''
import json, os, sys
env_before = dict(os.environ)
import speculators_compat
from speculators_compat.cli import _import_targets

speculators_compat.activate()
errors = _import_targets()
for extra in ("speculators.data_generation.config_generator", "speculators.data_generation.preprocessing"):
    try:
        __import__(extra)
    except Exception as exc:  # noqa: BLE001
        errors.append(f"import {extra}: {type(exc).__name__}: {exc}")
applied = sorted(r["id"] for r in speculators_compat.report() if r["status"] == "applied")
PREFIXES = ("vllm", "speculators", "transformers")


def ours(obj):
    try:
        return _ours(obj)
    except Exception:  # noqa: BLE001 - lazy placeholders (vLLM's optional imports) raise on any access
        return None


def _ours(obj):
    for o in (obj, getattr(obj, "__func__", None)):
        if o is None:
            continue
        if any(c.__name__ in ("ObjectProxy", "BaseObjectProxy") for c in type(o).__mro__):  # wrapt's C or Python proxy
            fn = getattr(o, "_self_wrapper", None)
            if fn is not None and (getattr(fn, "__module__", "") or "").startswith("speculators_compat"):
                return f"wrapt wrapper {fn.__module__}.{getattr(fn, '__qualname__', fn)}"
            continue
        try:
            mod = o.__dict__.get("__module__") if isinstance(o, type) else getattr(o, "__module__", None)
        except Exception:  # noqa: BLE001
            mod = None
        if isinstance(mod, str) and mod.startswith("speculators_compat"):
            return f"{type(o).__name__} from {mod}"
    return None


def scan():
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(PREFIXES) or name.startswith("speculators_compat"):
            continue
        doc = getattr(module, "__doc__", None) or ""
        if getattr(module, "__file__", None) is None and "speculators_compat" in doc:
            found.append(f"sys.modules[{name!r}]: a stand-in module")
        for attr, value in list(vars(module).items()):
            why = ours(value)
            if why:
                found.append(f"{name}.{attr}: {why}")
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    why = ours(cvalue)
                    if why:
                        found.append(f"{name}.{value.__qualname__}.{cattr}: {why}")
    return sorted(set(found))


while_applied = scan()
speculators_compat.deactivate()
after = scan()
env_after = dict(os.environ)
# importing vLLM / torch sets some of their own (LD_LIBRARY_PATH, TORCHINDUCTOR_*): only the
# shim's and vLLM's settings are its business
env_changed = sorted(k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k)
                     and k.startswith(("SPECULATORS_COMPAT_", "VLLM_")))

# control: everything applied again, then all reverted but one: the scan must find that one
reg = speculators_compat.get_registry()
speculators_compat.activate()
again = sorted(reg.applied_ids())
kept = next((p for p in again if p in ("worker-capture-hooks", "generate-driver")), again[0] if again else None)
for pid in again:
    if pid != kept:
        reg.revert(pid)
control = scan()
speculators_compat.deactivate()
print(json.dumps({"errors": errors, "applied": applied, "while_applied": while_applied, "after": after,
                  "env_changed": env_changed, "control_kept": kept,
                  "control_target": reg.patches[kept].target if kept else None, "control": control}))
'''


@pytest.fixture(scope="module")
def result():
    proc = subprocess.run([sys.executable, "-c", SCAN], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_gated_in_patch_applied_and_was_seen_by_the_scan(result):
    assert not result["errors"], result["errors"]
    assert len(result["applied"]) >= 10, result["applied"]
    # the scan sees what the shim replaced (else the test below would pass vacuously)
    assert len(result["while_applied"]) >= len(result["applied"]) // 2, result


def test_nothing_of_the_shim_is_left_after_deactivate(result):
    assert result["after"] == [], result["after"]
    assert result["env_changed"] == [], result["env_changed"]


def test_the_scan_finds_a_patch_left_applied(result):
    assert result["control_kept"], result
    module, _, attribute = result["control_target"].rpartition(".")
    hits = [h for h in result["control"] if attribute in h]
    assert hits and len(result["control"]) <= 3, (result["control_target"], result["control"])
