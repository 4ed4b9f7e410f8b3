"""Tests that need an NVIDIA GPU (marked ``cuda``; skipped elsewhere). A package, so its
conftest does not shadow the suite's ``conftest`` module."""
