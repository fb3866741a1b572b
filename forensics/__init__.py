"""Forensics: the store, content-addressed blobs, the flight recorder, incidents and replay.

Depends on engine types only; nothing here imports daemon or guards.

Public names are imported on first use (engine/lazy.py), so a light submodule loads alone.
"""

from engine.lazy import lazy_exports

__all__ = [
    "BlobStore",
    "FlightRecorder",
    "ForensicsConfig",
    "ForensicsError",
    "FsckReport",
    "GcReport",
    "ReplayResult",
    "Store",
    "canonical_digest",
    "export_incident",
    "fsck",
    "gc",
    "list_incidents",
    "replay",
    "show_incident",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "BlobStore": "forensics.blobs",
        "FlightRecorder": "forensics.recorder",
        "ForensicsConfig": "forensics.config",
        "ForensicsError": "forensics.errors",
        "FsckReport": "forensics.retention",
        "GcReport": "forensics.retention",
        "ReplayResult": "forensics.replay",
        "Store": "forensics.store",
        "canonical_digest": "forensics.blobs",
        "export_incident": "forensics.incidents",
        "fsck": "forensics.retention",
        "gc": "forensics.retention",
        "list_incidents": "forensics.incidents",
        "replay": "forensics.replay",
        "show_incident": "forensics.incidents",
    },
)
