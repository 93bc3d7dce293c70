"""Training script for foretell's demo model family (Qwen3 target + draft + MTP head,
Gemma-3 target) on the Python sources every machine has."""

__version__ = "0.1.0"
