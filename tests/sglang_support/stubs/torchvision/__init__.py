"""A stand-in for torchvision, importable but not usable (scripts/sglang_src.sh).

Why: SGLang's model configs import torchvision at import time (InternVL's
image transforms), and transformers' image utilities then import more of it.
torchvision's PyPI wheels are CUDA-linked (they fail to load beside the CPU
torch, which is why scripts/vllm_venv.sh removes them), so the SGLang
import checks put this package on the path instead. Any name resolves;
calling one raises ImportError naming it. Nothing the kvpool integration
tests calls into it.
"""

from ._missing import __getattr__  # noqa: F401

__version__ = "0.28.0+kvpool.stub"
