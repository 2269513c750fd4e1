"""Kernel tests run the Triton kernels in Triton's interpreter when no GPU is present: tests/conftest.py
sets TRITON_INTERPRET before any test module is collected."""
