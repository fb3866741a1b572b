"""Forensics: the store, content-addressed blobs, the flight recorder, incidents and replay.

Depends on engine types only; nothing here imports daemon or guards.

Public names are imported on first use (grpod/base/lazy.py), so a light submodule loads alone.
"""

from grpod.base.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "BlobStore": "grpod.forensics.blobs",
        "FlightRecorder": "grpod.forensics.recorder",
        "ForensicsConfig": "grpod.forensics.config",
        "ForensicsError": "grpod.forensics.errors",
        "FsckReport": "grpod.forensics.integrity",
        "GcReport": "grpod.forensics.integrity",
        "ReplayResult": "grpod.forensics.step_replay",
        "Store": "grpod.forensics.store",
        "canonical_digest": "grpod.forensics.blobs",
        "export_incident": "grpod.forensics.incidents",
        "fsck": "grpod.forensics.integrity",
        "gc": "grpod.forensics.integrity",
        "list_incidents": "grpod.forensics.incidents",
        "replay": "grpod.forensics.step_replay",
        "show_incident": "grpod.forensics.incidents",
    },
)
