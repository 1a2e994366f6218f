"""One settings module: every variable parsed one way, bad values named, docs/SETTINGS.md in step."""

import re
from pathlib import Path

import pytest

from speculators_compat import settings

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"
SETTINGS_DOC = README.parent / "docs" / "SETTINGS.md"


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("On", True), ("yes", True),
                                          ("0", False), ("false", False), ("OFF", False), ("no", False)])
def test_flags_parse_one_way(monkeypatch, raw, expected):
    monkeypatch.setenv("SPECULATORS_COMPAT_PIPELINE", raw)
    assert settings.flag("SPECULATORS_COMPAT_PIPELINE") is expected


def test_unset_and_empty_take_the_default(monkeypatch):
    monkeypatch.delenv("SPECULATORS_COMPAT_PIPELINE", raising=False)
    assert settings.flag("SPECULATORS_COMPAT_PIPELINE") is True
    monkeypatch.setenv("SPECULATORS_COMPAT_PIPELINE", " ")
    assert settings.flag("SPECULATORS_COMPAT_PIPELINE") is True
    monkeypatch.delenv("SPECULATORS_COMPAT_RPC_TIMEOUT", raising=False)
    assert settings.number("SPECULATORS_COMPAT_RPC_TIMEOUT") == 600.0


@pytest.mark.parametrize("name,raw,words", [
    ("SPECULATORS_COMPAT_PIPELINE", "maybe", "expected one of"),
    ("SPECULATORS_COMPAT_RPC_TIMEOUT", "-1", "greater than 0"),
    ("SPECULATORS_COMPAT_RPC_TIMEOUT", "0", "greater than 0"),
    ("SPECULATORS_COMPAT_RPC_TIMEOUT", "soon", "expected a number"),
    ("SPECULATORS_COMPAT_RPC_TIMEOUT", "nan", "finite"),
    ("SPECULATORS_COMPAT_KV_CACHE_BYTES", "lots", "expected a number"),
])
def test_bad_values_are_one_line_naming_the_variable(monkeypatch, name, raw, words):
    monkeypatch.setenv(name, raw)
    with pytest.raises(settings.SettingError) as info:
        settings.get(name)
    message = str(info.value)
    assert name in message and words in message and "\n" not in message


def test_settings_table_lists_exactly_the_settings():
    text = SETTINGS_DOC.read_text()
    documented = set(re.findall(r"^\| `(SPECULATORS_COMPAT_[A-Z_]+)", text, re.M))
    assert documented == set(settings.SETTINGS), (
        f"docs/SETTINGS.md lacks {sorted(set(settings.SETTINGS) - documented)}; "
        f"docs/SETTINGS.md has unknown {sorted(documented - set(settings.SETTINGS))}"
    )


def test_readme_names_only_real_settings():
    """README names settings in its prose; each must exist (a renamed one would mislead users)."""
    named = set(re.findall(r"SPECULATORS_COMPAT_[A-Z_]*[A-Z]", README.read_text()))
    assert named and named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))


def test_no_module_reads_our_variables_directly():
    src = Path(settings.__file__).parent
    offenders = []
    for path in src.rglob("*.py"):
        if path.name == "settings.py" or "testing" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            read = re.search(r"environ\.get\(\s*[\"']SPECULATORS_COMPAT_", line) or re.search(
                r"environ\[\s*[\"']SPECULATORS_COMPAT_\w+[\"']\s*\](?!\s*=[^=])", line)
            if read:
                offenders.append(f"{path.name}:{n}")
    assert not offenders, offenders


def test_readme_generated_tables_are_current():
    """README's tested table, docs/SETTINGS.md's settings and docs/PATCHES.md's patches are scripts/readme_tables.py's output."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(README.parent / "scripts" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
