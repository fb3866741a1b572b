"""Content-addressed blobs: `<run_dir>/blobs/sha256/<hex>` safetensors files.

The digest covers the canonical content (tensor names, dtypes, shapes and bytes in name
order, then the metadata sorted by key), not the file bytes: safetensors does not keep
metadata order stable. Files are written to a temp file, fsynced and renamed, so a blob
path holds a complete file or nothing; every read verifies the digest.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load, save

from engine.checkpoint import fsync_dir
from forensics.errors import ForensicsError

BLOB_DIR = Path("blobs") / "sha256"
TEMP_PREFIX = ".tmp-"


def canonical_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 hex over names, dtypes, shapes, bytes (name order) and sorted metadata."""
    h = hashlib.sha256(b"grpod.blob/1\0")
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        _field(h, name.encode())
        _field(h, str(tensor.dtype).encode())
        _field(h, ",".join(map(str, tensor.shape)).encode())
        data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        _field(h, memoryview(data).cast("B") if len(data) else b"")
    h.update(b"metadata\0")
    for key in sorted(metadata):
        _field(h, key.encode())
        _field(h, metadata[key].encode())
    return h.hexdigest()


def _field(h: hashlib._Hash, data: bytes | memoryview) -> None:
    h.update(struct.pack("<Q", len(data)))  # length-prefixed: no two contents hash alike
    h.update(data)


class BlobStore:
    """The blob files of one run directory. Rows live in the store; this class only does files."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / BLOB_DIR

    def relpath(self, digest: str) -> str:
        return str(BLOB_DIR / digest)

    def path(self, digest: str) -> Path:
        return self.root / digest

    def write(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
        """Write a blob durably; returns `(digest, file bytes)`. Idempotent per digest."""
        digest = canonical_digest(tensors, metadata)
        data = save({n: t.contiguous() for n, t in tensors.items()}, metadata=metadata)
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(digest)
        tmp = self.root / f"{TEMP_PREFIX}{digest}-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(self.root)
        return digest, len(data)

    def read(self, digest: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """`(tensors, metadata)` of a blob whose canonical digest is verified."""
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ForensicsError(f"blob {digest}: missing file {path}") from None
        except OSError as exc:
            raise ForensicsError(f"blob {digest}: unreadable file {path}: {exc}") from None
        try:
            tensors = load(data)
            metadata = _metadata(data)
        except Exception as exc:  # safetensors raises bare errors on damaged headers
            raise ForensicsError(
                f"blob {digest}: digest check failed, file {path} is not valid safetensors "
                f"({_first_line(exc)})"
            ) from None
        actual = canonical_digest(tensors, metadata)
        if actual != digest:
            raise ForensicsError(
                f"blob {digest}: digest mismatch, file {path} holds content {actual[:16]}..."
            )
        return tensors, metadata

    def verify(self, digest: str) -> None:
        """Raise ForensicsError unless the blob's file exists and its digest verifies."""
        self.read(digest)


def _metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (header: u64 length, then JSON)."""
    import json

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__", {}) or {})


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
