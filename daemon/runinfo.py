"""What a run records about the software and the device it trains on (`grpod run` and the
TRL trainer alike)."""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any


def software_versions() -> dict[str, str]:
    """{python, grpod, torch, transformers: version}; "unknown" for one not installed."""
    versions = {"python": sys.version.split()[0]}
    for name, dist in (("grpod", "grpod"), ("torch", "torch"), ("transformers", "transformers")):
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def device_name(device: Any = None) -> str:
    """What a run records as its device (`device`: a torch.device; default CUDA 0 or CPU)."""
    import torch

    device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
