"""OpenAI-compatible HTTP server: `tidal serve`, or `build_app(engine, name)` for an ASGI app."""

from tidal.server.api import build_app, run_server
from tidal.server.async_engine import AsyncEngine, EngineError

__all__ = ["build_app", "run_server", "AsyncEngine", "EngineError"]
