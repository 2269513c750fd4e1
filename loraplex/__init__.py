"""Loraplex: serve many LoRA adapters of one base LLM, fast and cheap.

This package is the torch-free core shared by every component (see DESIGN §2).
"""

__version__ = "0.1.0"
