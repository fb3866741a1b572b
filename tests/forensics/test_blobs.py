"""Content-addressed blobs: canonical digest, atomic write, verified read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpod.forensics import BlobStore, ForensicsError, canonical_digest
from grpod.forensics import blobs as blobs_module

TENSORS = {"a": torch.arange(6).reshape(2, 3), "b": torch.tensor([True, False])}
META = {"step": "3", "format": "x"}


def test_the_digest_of_a_known_content_never_changes() -> None:
    """Stored run dirs are read back by their digests: the bytes hashed are a format."""
    assert canonical_digest(TENSORS, META) == (
        "b1d4dc76714255914cc6cbc5cf1223177b0393cfc1bc95b02afaea0a7ce6c3e7"
    )
    odd = {
        "x": torch.arange(5, dtype=torch.float32),
        "e": torch.zeros(0, 3, dtype=torch.int64),  # no bytes
        "b": torch.tensor([True, False]),
    }
    assert canonical_digest(odd, {"k": "v", "a": ""}) == (
        "2621ce3549d38ee47a39daea96f6247c973df1a4cf16cfff78f93586166daded"
    )


def test_tensors_that_need_torch_to_reach_their_bytes_digest_as_their_plain_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain CPU tensors are read through numpy; a view, a tensor with grad and bf16 (which
    numpy lacks) through torch; a large blob is hashed part by part. Same bytes, same digest."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    odd = {
        "view": base[:, 1:4],  # not contiguous
        "grad": torch.ones(3, requires_grad=True),
        "bf16": torch.linspace(-2, 2, 5).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int16),
    }
    plain = {name: t.detach().clone().contiguous() for name, t in odd.items()}
    assert canonical_digest(odd, META) == canonical_digest(plain, META)
    assert canonical_digest({"bf16": odd["bf16"]}, {}) == (
        "689a3434ce5147ae05e0fb81c7b972086a380b59a50d63477c877243a56bef94"
    )
    joined = canonical_digest(TENSORS, META)
    monkeypatch.setattr(blobs_module, "JOIN_BYTES", 0)  # every part its own update
    assert canonical_digest(TENSORS, META) == joined
    assert canonical_digest(odd, META) == canonical_digest(plain, META)


def test_digest_covers_content_not_file_bytes() -> None:
    base = canonical_digest(TENSORS, META)
    assert canonical_digest(dict(reversed(TENSORS.items())), dict(reversed(META.items()))) == base
    assert canonical_digest({**TENSORS, "a": TENSORS["a"].to(torch.int32)}, META) != base
    assert canonical_digest({**TENSORS, "a": TENSORS["a"].reshape(3, 2)}, META) != base
    assert canonical_digest({"c": TENSORS["a"], "b": TENSORS["b"]}, META) != base
    assert canonical_digest(TENSORS, {**META, "step": "4"}) != base
    assert canonical_digest({**TENSORS, "a": TENSORS["a"] + 1}, META) != base


def test_write_then_read_verifies(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    digest, size = blobs.write(TENSORS, META)
    path = tmp_path / "blobs" / "sha256" / digest
    assert path.stat().st_size == size
    assert blobs.write(TENSORS, META) == (digest, size)  # idempotent
    tensors, metadata = blobs.read(digest)
    assert metadata == META and all(torch.equal(tensors[n], TENSORS[n]) for n in TENSORS)
    assert [p.name for p in path.parent.iterdir()] == [digest]  # no temp file left


def test_flipped_byte_is_a_digest_error(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    digest, size = blobs.write(TENSORS, META)
    path = blobs.path(digest)
    data = bytearray(path.read_bytes())
    data[size - 1] ^= 0x01  # the last tensor byte
    path.write_bytes(bytes(data))
    with pytest.raises(ForensicsError, match=f"blob {digest}: digest mismatch"):
        blobs.read(digest)
    path.write_bytes(b"\x07" * 8 + path.read_bytes()[8:])  # a damaged header
    with pytest.raises(ForensicsError, match="digest check failed"):
        blobs.read(digest)
    path.unlink()
    with pytest.raises(ForensicsError, match="missing file"):
        blobs.read(digest)
