"""Content-addressed blobs: safetensors files `<run_dir>/blobs/sha256/<hex>`, or the same bytes
inline in the blob's store row (`stage(..., inline_max=N)`: blobs up to N bytes).

The digest covers the canonical content (tensor names, dtypes, shapes and bytes in name
order, then the metadata sorted by key), not the file bytes: safetensors does not keep
metadata order stable. Files are written to a temp file, fsynced and renamed, so a blob
path holds a complete file or nothing; every read verifies the digest. `stage` + `publish`
split that write so that one directory fsync can cover a group of blobs. An inline blob is
staged in memory and needs no publish: its bytes commit in the same transaction as its row.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load, save

from grpod.base.fileio import fsync
from grpod.base.oneline import first_line
from grpod.forensics.errors import ForensicsError

BLOB_DIR = Path("blobs") / "sha256"
TEMP_PREFIX = ".tmp-"
# dtype names of the safetensors format (its spec); other dtypes go through `save`
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def canonical_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 hex over names, dtypes, shapes, bytes (name order) and sorted metadata."""
    return _digest_and_chunks(tensors, metadata)[0]


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, list]:
    """`(canonical digest, safetensors file as a list of byte chunks)` in one pass over the
    tensors' bytes: the same file `safetensors.torch.save` writes up to the header's key
    order and padding, which readers do not depend on."""
    digest, chunks = _digest_and_chunks(tensors, metadata)
    if sys.byteorder != "little" or any(t.dtype not in _SAFETENSORS_DTYPES for _, t, _ in chunks):
        data = save({n: t.contiguous() for n, t, _ in chunks}, metadata=metadata)
        return digest, [data]
    layout = _header_tensors(tuple((name, t.dtype, t.shape) for name, t, _ in chunks))
    if metadata:  # what json.dumps of {"__metadata__": metadata, **layout} writes
        text = b'{"__metadata__":%s,%s' % (
            json.dumps(metadata, separators=(",", ":")).encode(),
            layout[1:],
        )
    else:
        text = layout
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    return digest, [struct.pack("<Q", len(text)), text, *(data for _, _, data in chunks)]


@lru_cache(maxsize=64)
def _header_tensors(layout: tuple[tuple[str, torch.dtype, torch.Size], ...]) -> bytes:
    """The header's JSON object of the tensors (name, dtype, shape) in order, each at its
    offset: a run's batches repeat a few layouts, so each is written once."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in layout:
        size = shape.numel() * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return json.dumps(header, separators=(",", ":")).encode()


@lru_cache(maxsize=256)
def _fields(name: str, dtype: torch.dtype, shape: torch.Size) -> bytes:
    """A tensor's name, dtype and shape as the digest hashes them, each length-prefixed (a
    run's batches repeat a few, so each is encoded once)."""
    out = []
    for field in (name, str(dtype), ",".join(map(str, shape))):
        encoded = field.encode()
        out += (_LENGTH.pack(len(encoded)), encoded)
    return b"".join(out)


def _digest_and_chunks(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[str, list[tuple[str, torch.Tensor, memoryview | bytes]]]:
    """The canonical digest, and (name, CPU contiguous tensor, its bytes) in name order.

    The hash reads each field length-prefixed: names, dtypes and shapes, each tensor's
    bytes, then the metadata by key. A batch of at most JOIN_BYTES is hashed in one update
    of the joined stream (the same bytes, so the same digest): hashlib lets go of the GIL for
    every update of 2 KiB or more, and on the recorder's writer thread each time it does is
    a wait for the trainer to give it back."""
    stream: list[bytes | memoryview] = [b"grpod.blob/1\0"]  # the hashed bytes, in order
    chunks = []
    size = 0  # the tensors' bytes (the fields around them are a few hundred more)
    for name in sorted(tensors):
        tensor, data = _bytes_of(tensors[name])
        stream += (_fields(name, tensor.dtype, tensor.shape), _LENGTH.pack(len(data)), data)
        chunks.append((name, tensor, data))
        size += len(data)
    stream.append(b"metadata\0")
    for key in sorted(metadata):
        for field in (key, metadata[key]):
            encoded = field.encode()
            stream += (_LENGTH.pack(len(encoded)), encoded)
    h = hashlib.sha256()
    if size <= JOIN_BYTES:
        h.update(b"".join(stream))  # one call: the writer gives up the GIL once, not per tensor
    else:
        for part in stream:  # a large batch's bytes as they lie: never copied
            h.update(part)
    return h.hexdigest(), chunks


_LENGTH = struct.Struct("<Q")  # every field length-prefixed: no two contents hash alike
JOIN_BYTES = 1024**2  # a blob up to this size is hashed in one update (one copy of it)


def _bytes_of(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview | bytes]:
    """A CPU contiguous tensor and a view of its bytes, never copied.

    A batch's tensors are already CPU, contiguous and without grad, and then the bytes come
    through numpy alone: every torch call here releases and retakes the GIL, which on the
    recorder's writer thread means waiting for the trainer between calls (10 tensors, 60 calls
    a step). Other tensors (bf16, which numpy lacks; a view; a GPU tensor) go through torch."""
    if not tensor.numel():
        return tensor, b""
    if (
        tensor.is_cpu
        and not tensor.requires_grad
        and tensor.dtype in _NUMPY_DTYPES
        and tensor.is_contiguous()
    ):
        return tensor, memoryview(tensor.numpy()).cast("B")
    tensor = tensor.detach().contiguous().cpu()
    return tensor, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


_NUMPY_DTYPES = frozenset(_SAFETENSORS_DTYPES) - {torch.bfloat16}  # tensor.numpy() reads these


@dataclass(frozen=True)
class StagedBlob:
    """A blob written to its temp file (complete, but neither durable nor in place yet), or,
    when `data` is set, an inline blob held in memory for its row."""

    digest: str
    size: int  # safetensors bytes
    temp: Path | None
    data: bytes | None = None


class BlobStore:
    """The blobs of one run directory: their files, and the bytes of inline ones (which the
    caller reads from the blob's row). Rows live in the store."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / BLOB_DIR
        self._root_made = False

    def relpath(self, digest: str) -> str:
        return str(BLOB_DIR / digest)

    def path(self, digest: str) -> Path:
        return self.root / digest

    def write(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
        """Write a blob durably; returns `(digest, file bytes)`. Idempotent per digest."""
        staged = self.stage(tensors, metadata)
        self.publish([staged])
        return staged.digest, staged.size

    def stage(
        self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], inline_max: int = 0
    ) -> StagedBlob:
        """Serialise a blob into its temp file (no fsync; `publish` puts it in place), or into
        memory when it is at most `inline_max` bytes (its row will hold it)."""
        digest, chunks = encode(tensors, metadata)
        size = sum(len(c) for c in chunks)
        if size <= inline_max:
            return StagedBlob(digest, size, None, b"".join(chunks))
        if not self._root_made:
            self.root.mkdir(parents=True, exist_ok=True)
            self._root_made = True
        temp = self.root / f"{TEMP_PREFIX}{digest}-{os.getpid()}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            written = os.writev(fd, chunks)  # one syscall for the header and every tensor
            rest = memoryview(b"".join(chunks))[written:] if written < size else b""
            while rest:  # a short write (rare): the rest in order
                rest = rest[os.write(fd, rest) :]
        finally:
            os.close(fd)
        return StagedBlob(digest, size, temp)

    def publish(self, staged: list[StagedBlob]) -> None:
        """Make staged blobs durable and visible: fsync every temp file, rename each into
        place, then fsync the directory once. A digest staged twice is published once."""
        unique = list({b.digest: b for b in staged if b.temp is not None}.values())
        for blob in unique:
            fsync(blob.temp)  # the file's bytes are on disk before its name is
        for blob in unique:
            os.replace(blob.temp, self.path(blob.digest))
        if unique:
            fsync(self.root)

    def read(
        self, digest: str, data: bytes | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """`(tensors, metadata)` of a blob whose canonical digest is verified: from its file,
        or from `data`, the bytes its row holds inline."""
        path = self.path(digest)
        where = f"file {path}"
        if data is not None:
            where = "its store row"
        else:
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
                f"blob {digest}: digest check failed, {where} is not valid safetensors "
                f"({first_line(exc)})"
            ) from None
        actual = canonical_digest(tensors, metadata)
        if actual != digest:
            raise ForensicsError(
                f"blob {digest}: digest mismatch, {where} holds content {actual[:16]}..."
            )
        return tensors, metadata

    def verify(self, digest: str, data: bytes | None = None) -> None:
        """Raise ForensicsError unless the blob (its file, or `data`) verifies."""
        self.read(digest, data)


def _metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (header: u64 length, then JSON)."""
    import json

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__", {}) or {})
