"""OpenAI-compatible HTTP server: `tidal serve`, or `build_app(engine, name)` for an ASGI app."""

import importlib

__all__ = ["build_app", "run_server", "AsyncEngine", "EngineError"]

_HOMES = {"build_app": "api", "run_server": "api", "AsyncEngine": "async_engine", "EngineError": "async_engine"}


def __getattr__(name: str):
    # Imported on first use: the engine core's process imports `tidal.server.core_process`,
    # which needs none of the HTTP side (fastapi, uvicorn: most of a second of its start-up).
    if name in _HOMES:
        return getattr(importlib.import_module(f"tidal.server.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
