"""Backend selection: PyTorch anywhere, Triton kernels for CUDA tensors."""
from __future__ import annotations

import importlib.util

BACKENDS = ("torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def pick_backend(cache, backend=None) -> str:
    """``backend`` None picks Triton for CUDA caches when triton is installed, else PyTorch."""
    if backend is None:
        return "triton" if cache.device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the triton package")
    return backend
