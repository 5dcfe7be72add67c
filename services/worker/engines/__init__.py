"""Engine implementations and the factory the worker uses to pick one.

`sim` is always available. `hf` and `vllm` import heavy libraries (torch,
transformers, vllm), so they are imported only when chosen; `openai-http` fronts an
engine server over HTTP and needs the `openai` package.
"""
from __future__ import annotations

import importlib

from polyserve.worker.engine import Engine, EngineError

ENGINES = ("sim", "hf", "vllm", "encoder", "openai-http")
_LAZY = {
    "hf": ("polyserve.worker.engines.hf", "HfEngine"),
    "vllm": ("polyserve.worker.engines.vllm_engine", "VllmEngine"),
    "encoder": ("polyserve.worker.engines.encoder", "EncoderEngine"),
    "openai-http": ("polyserve.worker.engines.openai_http", "OpenAIHttpEngine"),
}


def make_engine(settings) -> Engine:
    """The engine named by `settings.engine`, built from the worker settings.

    Raises EngineError when the name is unknown or the engine cannot be imported
    (its module or one of its libraries is missing), saying which.
    """
    name = settings.engine
    if name == "sim":
        from polyserve.worker.engines.sim import SimEngine

        return SimEngine.from_settings(settings)
    if name not in _LAZY:
        raise EngineError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}", 400)
    module_name, class_name = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineError(f"engine {name!r} is not available: cannot import {module_name} "
                          f"({exc}); install its extras or use engine=sim", 500) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise EngineError(f"engine {name!r}: {module_name} has no {class_name}", 500)
    from_settings = getattr(cls, "from_settings", None)
    return from_settings(settings) if from_settings is not None else cls(settings)
