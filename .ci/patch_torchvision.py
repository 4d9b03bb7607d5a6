"""Make PyPI's (CUDA-built) torchvision importable beside a CPU torch.

torchvision/_meta_registrations.py registers fake kernels for the C++ ops
``torchvision::nms`` and ``torchvision::qnms`` unconditionally; with a CPU torch
those ops do not exist and ``import torchvision`` fails. vLLM's Qwen2-VL code
imports torchvision but never uses those ops, so we guard the two registrations.
Idempotent.
"""

import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.origin is None:
    print("patch_torchvision: torchvision not installed, nothing to do")
    sys.exit(0)
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
marker = "# lmcache-ec-broker: guarded"
if marker in text:
    sys.exit(0)
guard = "(lambda f: f) if not __import__('torchvision').extension._has_ops() else "
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")'
    if old not in text:
        print(f"patch_torchvision: pattern for {op} not found; leaving file as is")
        sys.exit(0)
    text = text.replace(old, "@(" + guard + f'torch.library.register_fake("torchvision::{op}"))')
path.write_text(text + f"\n{marker}\n")
print(f"patch_torchvision: patched {path}")
