"""The ``cuda`` marker: tests that copy between real CUDA tensors and the arena. Where no GPU is
usable they are collected and skipped, saying why."""

import pytest


def cuda_unavailable():
    """Why CUDA tests cannot run here, or ``None`` when they can."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no torch
        return f"torch is not importable ({e.__class__.__name__}: {e})"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs an NVIDIA GPU and torch with CUDA (scripts/gpu-check.sh runs them)"
    )


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("cuda") is None:
            continue
        if reason is None:
            reason = cuda_unavailable() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"cuda test: {reason}"))
