"""Forensics: the store, content-addressed blobs, the flight recorder, incidents and replay.

Depends on engine types only; nothing here imports daemon or guards.
"""

from forensics.blobs import BlobStore, canonical_digest
from forensics.config import ForensicsConfig
from forensics.errors import ForensicsError
from forensics.incidents import export_incident, list_incidents, show_incident
from forensics.recorder import FlightRecorder
from forensics.replay import ReplayResult, replay
from forensics.retention import FsckReport, GcReport, fsck, gc
from forensics.store import Store

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
