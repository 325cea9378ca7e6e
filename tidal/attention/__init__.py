"""Attention backends: one small protocol, a torch reference (CPU oracle) and Triton kernels."""

from tidal.attention.base import AttentionBackend, get_backend

__all__ = ["AttentionBackend", "get_backend"]
