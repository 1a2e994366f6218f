"""Engine options the hand-built ``VllmConfig`` has no way to receive (``engine-options``).

On CPU: the ``rotary_embedding`` custom op off (wrong for non-neox rope: DeepSeek, Kimi) and the
attention block size kept at one the installed kernel runs; ``SPECULATORS_COMPAT_ATTENTION_BACKEND``
selects attention, ``SPECULATORS_COMPAT_ADDITIONAL_CONFIG`` gives ``additional_config``;
``CacheConfig.sliding_window`` set as vLLM's engine derives it (all-sliding models would run full
attention). ``cpu-rms-norm-native``: ``RMSNorm`` runs PyTorch on CPU where
0.12-0.13's kernel reads strided input wrongly. Versions: compat_matrix.yaml.
Details: docs/MODULES.md.
"""

from __future__ import annotations

import logging
import sys

from ..registry import Call, NotNeeded, wrapper_patch
from ..settings import SettingError
from ._signatures import GENERATOR, accepts, import_attr, parameters, require_params

logger = logging.getLogger("speculators_compat")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_sliding_window(model_config) -> int | None:
    """``CacheConfig.sliding_window`` as the installed ``EngineArgs.create_engine_config`` derives
    it for ``model_config``: the model's window when every layer slides, else None."""
    from vllm.engine.arg_utils import EngineArgs

    text_config = model_config.hf_text_config
    rule = sliding_window_rule(EngineArgs.create_engine_config)
    if rule == "not-interleaved":  # 0.11-0.26
        from vllm.transformers_utils.config import is_interleaved

        all_sliding = not is_interleaved(text_config)
    elif rule == "all-sliding-layer-types":  # 0.29+
        layer_types = getattr(text_config, "layer_types", None)
        all_sliding = layer_types is None or all(t == "sliding_attention" for t in layer_types)
    else:
        raise RuntimeError("EngineArgs.create_engine_config: expected its sliding-window rule (a call of "
                           "is_interleaved, or a layer_types / 'sliding_attention' test); found neither")
    return model_config.get_sliding_window() if all_sliding else None


def sliding_window_rule(create_engine_config) -> str | None:
    """Which rule ``create_engine_config``'s code applies for ``CacheConfig.sliding_window``:
    ``"not-interleaved"``, ``"all-sliding-layer-types"``, or None (neither marker found)."""
    if "is_interleaved" in _code_names(create_engine_config):
        return "not-interleaved"
    # layer_types as a string (getattr(cfg, "layer_types")) or as an attribute (cfg.layer_types)
    words = _code_constants(create_engine_config) | _code_names(create_engine_config)
    if {"layer_types", "sliding_attention"} <= words:
        return "all-sliding-layer-types"
    return None


def _set_engine_sliding_window(kwargs) -> None:
    cache_config, model_config = kwargs.get("cache_config"), kwargs.get("model_config")
    if cache_config is None or model_config is None or getattr(cache_config, "sliding_window", None) is not None:
        return
    window = engine_sliding_window(model_config)
    if window is not None:
        cache_config.sliding_window = window


def _set_cpu_attention_block_size(kwargs) -> None:
    cache_config, model_config = kwargs.get("cache_config"), kwargs.get("model_config")
    if cache_config is None or model_config is None or getattr(model_config, "use_mla", False):
        return  # MLA runs its own CPU kernels, not cpu_attn's
    from .cpu_attention import attention_plan

    own = getattr(sys.modules.get(GENERATOR), "VLLM_BLOCK_SIZE", 16)
    # 0.32+: an unset block size reads as DEFAULT_BLOCK_SIZE with user_specified_block_size False,
    # and the platform still picks its own
    requested = cache_config.block_size if getattr(cache_config, "user_specified_block_size", True) else None
    try:
        plan = attention_plan(model_config.dtype, model_config.get_head_size(), requested, own=own,
                              kv_cache_dtype=getattr(cache_config, "cache_dtype", None))
    except Exception as exc:  # noqa: BLE001 - the rest of engine-options still applies; check reports it
        logger.warning("speculators_compat: cannot read vLLM's CPU attention rule (%s: %s); the platform's "
                       "block size stands", type(exc).__name__, exc)
        return
    if plan.problem:
        raise RuntimeError(f"speculators-compat: {plan.problem}")
    if plan.block_size is not None:
        logger.warning("speculators_compat: %s; the engine gets block size %d", plan, plan.block_size)
        cache_config.block_size = plan.block_size
        if hasattr(cache_config, "user_specified_block_size"):
            cache_config.user_specified_block_size = True  # else the platform replaces it


def _vllm_config_options(wrapped, instance, args, kwargs):
    _set_engine_sliding_window(kwargs)
    if on_cpu():
        _set_cpu_attention_block_size(kwargs)
    if on_cpu():
        from vllm.config import CompilationConfig

        compilation = kwargs.get("compilation_config")
        if compilation is None:
            compilation = CompilationConfig()
            kwargs["compilation_config"] = compilation
        if "-rotary_embedding" not in compilation.custom_ops:
            compilation.custom_ops = [*compilation.custom_ops, "-rotary_embedding"]
    from ..settings import text

    backend = text("SPECULATORS_COMPAT_ATTENTION_BACKEND")
    if backend and accepts(wrapped, "attention_config") and "attention_config" not in kwargs:
        from vllm.config import AttentionConfig

        kwargs["attention_config"] = AttentionConfig(backend=backend)
    extra = additional_config()
    if extra:
        if not accepts(wrapped, "additional_config"):
            raise SettingError("SPECULATORS_COMPAT_ADDITIONAL_CONFIG: this vLLM's VllmConfig takes no additional_config")
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), **extra}
    return wrapped(*args, **kwargs)


def additional_config() -> dict:
    """``SPECULATORS_COMPAT_ADDITIONAL_CONFIG`` as a dict ({} unset); anything but a JSON object is
    one line."""
    import json

    from ..settings import text

    raw = text("SPECULATORS_COMPAT_ADDITIONAL_CONFIG")
    if raw is None:
        return {}
    shown = repr(raw)
    shown = shown if len(shown) <= 80 else shown[:76] + "..." + shown[0]
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise SettingError(f"SPECULATORS_COMPAT_ADDITIONAL_CONFIG={shown}: expected a JSON object; found invalid "
                           f"JSON ({str(exc).splitlines()[0][:80]})") from None
    except RecursionError:
        raise SettingError(f"SPECULATORS_COMPAT_ADDITIONAL_CONFIG={shown}: expected a JSON object; found one "
                           "nested too deeply to read") from None
    if not isinstance(value, dict):
        raise SettingError(f"SPECULATORS_COMPAT_ADDITIONAL_CONFIG={shown}: expected a JSON object; "
                           f"found {type(value).__name__}")
    return value


def _probe(current):
    real = import_attr("vllm.config", "VllmConfig")
    problem = require_params(real, ("compilation_config", "model_config", "parallel_config"), "vllm.config.VllmConfig")
    if problem:
        return problem
    compilation = import_attr("vllm.config", "CompilationConfig")
    if not accepts(compilation, "custom_ops"):
        return "expected CompilationConfig(custom_ops=...); not found"
    problem = require_params(import_attr("vllm.config", "CacheConfig"), ("sliding_window",), "vllm.config.CacheConfig")
    if problem:
        return problem
    if not callable(getattr(import_attr("vllm.config", "ModelConfig"), "get_sliding_window", None)):
        return "expected ModelConfig.get_sliding_window(); not found"
    create = getattr(import_attr("vllm.engine.arg_utils", "EngineArgs"), "create_engine_config", None)
    if create is None:
        return "expected EngineArgs.create_engine_config (the sliding-window rule is read off it); not found"
    rule = sliding_window_rule(create)
    if rule is None:
        return ("expected EngineArgs.create_engine_config to derive CacheConfig.sliding_window by a known rule "
                "(calls is_interleaved, or tests layer_types for 'sliding_attention'); found neither")
    if rule == "not-interleaved":
        try:
            import_attr("vllm.transformers_utils.config", "is_interleaved")
        except (ImportError, AttributeError) as exc:
            return f"expected vllm.transformers_utils.config.is_interleaved (create_engine_config uses it); not found ({exc})"
    return None


def _codes(fn):
    """The code object of a function (or method) and every code nested in it (comprehensions,
    generator expressions, inner functions); empty for a callable without Python code."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    todo = [code] if code is not None else []
    while todo:
        c = todo.pop()
        yield c
        todo.extend(k for k in c.co_consts if hasattr(k, "co_consts"))


def _code_names(fn) -> set[str]:
    """Names a function's code and the code nested in it refer to (attributes and globals)."""
    return {name for c in _codes(fn) for name in c.co_names}


def _code_constants(fn) -> set[str]:
    """String constants of a function's code and of the code nested in it, those inside tuple
    and frozenset constants (``x in ("a", "b")``) included."""
    found: set[str] = set()
    for c in _codes(fn):
        for k in c.co_consts:
            for v in (k if isinstance(k, (tuple, frozenset)) else (k,)):
                if isinstance(v, str):
                    found.add(v)
    return found


def cpu_rms_norm_reaches_strided_kernel(rms_norm_cls, custom_ops_rms_norm) -> str | None:
    """None where ``RMSNorm`` on CPU hands its input, strides and all, to vLLM's compiled
    ``rms_norm`` kernel; else why not (the patch is then not needed)."""
    forward_cpu = getattr(rms_norm_cls, "forward_cpu", None)
    if forward_cpu is None or "forward_cuda" not in _code_names(forward_cpu):
        return "RMSNorm.forward_cpu does not reach forward_cuda (vLLM runs forward_native on CPU)"
    if "contiguous" in _code_names(custom_ops_rms_norm):
        return "vllm._custom_ops.rms_norm makes its input contiguous"
    return None


def disable_rms_norm_op(custom_ops: list) -> bool:
    """Add ``-rms_norm`` to a ``custom_ops`` list in place; False where ``+rms_norm`` asks for
    the op explicitly (left alone) or it is already off."""
    if "-rms_norm" in custom_ops or "+rms_norm" in custom_ops:
        return False
    custom_ops.append("-rms_norm")
    return True


def _native_rms_norm_on_cpu(wrapped, instance, args, kwargs):
    config = wrapped(*args, **kwargs)
    if on_cpu():
        custom_ops = config.compilation_config.custom_ops
        if not disable_rms_norm_op(custom_ops) and "+rms_norm" in custom_ops:
            logger.warning(
                "speculators_compat: compilation_config.custom_ops has +rms_norm; vLLM's CPU rms_norm "
                "kernel ignores input strides on this version (q/k-norm models come out wrong)"
            )
    return config


def _probe_rms_norm(current):
    if parameters(current) is None:
        return "expected VllmHiddenStatesGenerator._create_vllm_config to be a method"
    if not on_cpu():
        return NotNeeded("not the CPU platform (the CPU rms_norm kernel is the one that ignores strides)")
    compilation = import_attr("vllm.config", "CompilationConfig")
    if not accepts(compilation, "custom_ops"):
        return "expected CompilationConfig(custom_ops=...); not found"
    if not accepts(import_attr("vllm.config", "VllmConfig"), "compilation_config"):  # config.compilation_config.custom_ops
        return "expected VllmConfig(compilation_config=...); not found"
    rms_norm = import_attr("vllm.model_executor.layers.layernorm", "RMSNorm")
    if getattr(rms_norm, "name", None) != "rms_norm":
        return f"expected RMSNorm registered as custom op 'rms_norm'; found {getattr(rms_norm, 'name', None)!r}"
    reason = cpu_rms_norm_reaches_strided_kernel(rms_norm, import_attr("vllm._custom_ops", "rms_norm"))
    return NotNeeded(reason) if reason else None


# speculators' VllmConfig(...) with what this patch adds where the signature accepts it; the rest it calls
OPTIONS_CALLS = (
    Call("vllm.config", "VllmConfig", kwargs=("model_config", "cache_config", "parallel_config", "scheduler_config",
                                              "device_config", "load_config", "compilation_config")),
    Call("vllm.config", "CompilationConfig"),
    Call("vllm.config", "AttentionConfig", kwargs=("backend",), optional=True),  # 0.14+
    Call("vllm.config", "ModelConfig.get_sliding_window"),
    Call("vllm.config", "ModelConfig.get_head_size"),
    Call("vllm.transformers_utils.config", "is_interleaved", args=("config",), optional=True),  # until 0.26
    Call("vllm.platforms", "current_platform.is_cpu"),
)

PATCHES = [
    wrapper_patch("engine-options", "platform", GENERATOR, "VllmConfig", _vllm_config_options, _probe,
                  calls=OPTIONS_CALLS),
    wrapper_patch(
        "cpu-rms-norm-native",
        "platform",
        GENERATOR,
        "VllmHiddenStatesGenerator._create_vllm_config",
        _native_rms_norm_on_cpu,
        _probe_rms_norm,
    ),
]
