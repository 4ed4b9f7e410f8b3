"""Type stubs of the kvtier extension module."""

import os
import pathlib
from typing import Any, Iterable, Optional, Sequence

KEY_BYTES: int
"""Length of a packed key: 32-byte block hash + 4-byte big-endian group index."""

Key = bytes
"""A key: vLLM's packing (36 bytes), or a bare 32-byte hash meaning group 0."""

class KvtierError(Exception):
    """An error reported by kvtier, carrying the Rust message."""

class ConfigError(KvtierError):
    """A chain file or TOML text that cannot be parsed, resolved or built."""

class StepError(KvtierError):
    """A step used wrongly (second step on one thread, released step, handle call mid-step)."""

def chain_arena_path(path: "os.PathLike[str] | str") -> Optional[str]:
    """The arena file a chain's primary tier shares ([primary] shared_memory, ${tmpdir}
    expanded), or None. Raises ConfigError for an invalid chain or a path using ${pid}."""

def make_offload_key(block_hash: bytes, group_idx: int = 0) -> bytes:
    """Packs a 32-byte block hash and a KV-group index into a 36-byte key."""

def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """Splits a key into (block_hash, group_idx)."""

class LookupResult:
    """The verdict of a lookup (vLLM's LookupResult). Not an ``enum.Enum``: the four values are
    class attributes, compare with ``is`` or ``==``, hash, and convert with ``int()``."""

    HIT: "LookupResult"
    HIT_PENDING: "LookupResult"
    MISS: "LookupResult"
    RETRY: "LookupResult"
    def __int__(self) -> int: ...

class OffloadPolicy:
    """What a request wants offloaded. Not an ``enum.Enum``: the values are class attributes,
    compare with ``is`` or ``==``, hash, and convert with ``int()``."""

    CHUNK_LEVEL: "OffloadPolicy"
    REQUEST_LEVEL: "OffloadPolicy"
    def __int__(self) -> int: ...

class PrepareStoreOutput:
    """Result of prepare_store."""

    keys_to_store: list[bytes]
    """Keys that need writing (resident ones filtered out), in offer order."""
    chunk_ids: list[int]
    """Destination arena rows, parallel to keys_to_store (vLLM's store_spec)."""
    evicted: list[bytes]
    """Keys evicted to make room."""
    evicted_keys: list[bytes]
    """vLLM's name for evicted."""

class OffloadingEvent:
    """Keys stored in, or removed from, one tier."""

    keys: list[bytes]
    medium: Optional[str]
    """"CPU", "STORAGE" or None."""
    locality: Optional[str]
    """"LOCAL", "REMOTE" or None."""
    removed: bool
    ownership: Optional[str]
    """The emitting secondary tier's name; None for the primary tier."""
    metadata_only: bool
    """A removal of keys that never became readable (a failed store)."""
    removal_expected: bool
    """A store whose removal the tier will report too (it evicts on its own)."""

class LoadSource:
    """Where a chunk a request loads came from (Step.load_source)."""

    tier: str
    """The tier's name (as in stats())."""
    tier_type: str
    """The tier's type in the chain file ("cpu", "disk", "p2p", "redis", a plugin's)."""
    secondary: Optional[int]
    """The secondary tier's index in chain order; None for the primary tier."""
    medium: Optional[str]
    """"CPU", "STORAGE" or None."""
    locality: Optional[str]
    """"LOCAL", "REMOTE" or None."""

class ScheduleEndContext:
    """What the engine tells the manager at the end of a scheduler step."""

    new_req_ids: list[str]
    preempted_req_ids: list[str]
    def __init__(
        self, new_req_ids: Sequence[str] = (), preempted_req_ids: Sequence[str] = ()
    ) -> None: ...

class ReqContext:
    """One request's context; keep one instance per request for all its calls."""

    req_id: str
    def __init__(
        self,
        req_id: str,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        load_tier_filter: Optional[Sequence[dict[str, Optional[str]]]] = None,
    ) -> None: ...
    def set_offload_key_position(self, key: Key, position: int) -> None:
        """Records the end-token position of key in the request."""
    def get_offload_key_position(self, key: Key) -> Optional[int]:
        """The recorded position of key, if any."""

class Step:
    """One scheduler step: holds the manager's lock until released (context manager)."""

    released: bool
    def lookup(self, key: Key, req_context: ReqContext) -> LookupResult: ...
    def prepare_load(self, keys: Iterable[Key], req_context: ReqContext) -> list[int]:
        """Pins HIT keys; returns their arena rows in key order."""
    def touch(self, keys: Iterable[Key], req_context: ReqContext) -> None: ...
    def complete_load(self, keys: Iterable[Key], req_context: ReqContext) -> None: ...
    def prepare_store(
        self, keys: Iterable[Key], req_context: ReqContext
    ) -> Optional[PrepareStoreOutput]:
        """Reserves rows for new chunks; None when there is no room."""
    def complete_store(
        self, keys: Iterable[Key], req_context: ReqContext, success: bool = True
    ) -> None: ...
    def on_new_request(self, req_context: ReqContext) -> OffloadPolicy: ...
    def on_request_finished(self, req_context: ReqContext) -> None: ...
    def on_schedule_end(self, ctx: Optional[ScheduleEndContext] = None) -> None: ...
    def load_source(self, key: Key, req_context: ReqContext) -> LoadSource:
        """The tier key's chunk came from for this request (ask after a HIT): the secondary
        whose promotion brought it into the primary for the request, else the primary."""
    def take_events(self) -> list[OffloadingEvent]: ...
    def has_pending_work(self) -> bool: ...
    def release_reset_fence(self) -> int:
        """The copies queued at the last fencing reset are over; returns the rows released."""
    def stats(self) -> dict[str, Any]: ...
    def release(self) -> None:
        """Releases the lock now (idempotent)."""
    def __enter__(self) -> "Step": ...
    def __exit__(self, *exc: object) -> bool: ...

class TieringManager:
    """A tiering manager over a chain of tiers built from a chain file."""

    num_chunks: int
    chunk_bytes: int
    row_stride: int
    arena_path: Optional[pathlib.Path]
    arena_fingerprint: int
    control_thread_running: bool
    tiers: list[dict[str, Any]]
    """The chain's tiers as built, primary first: {"name", "type", "medium" ("CPU"/"STORAGE"/None),
    "locality" ("LOCAL"/"REMOTE"/None), "secondary" (index in chain order; None: the primary)}."""
    @staticmethod
    def from_config(
        path: "os.PathLike[str] | str", chunk_bytes: int, reporters: Optional[int] = None
    ) -> "TieringManager": ...
    @staticmethod
    def from_toml(
        text: str, chunk_bytes: int, source: str = "<string>", reporters: Optional[int] = None
    ) -> "TieringManager": ...
    def step(self) -> Step:
        """Waits (GIL released) for the manager's lock; exit the step before the model runs."""
    def has_pending_work(self) -> bool: ...
    def take_events(self) -> list[OffloadingEvent]: ...
    def stats(self) -> dict[str, Any]: ...
    def get_stats(self) -> dict[str, Any]: ...
    def reset_cache(self) -> None: ...
    def reset_cache_fencing_writes(self) -> int:
        """reset_cache keeping rows with a write in flight unallocated until release_reset_fence;
        returns how many rows are fenced."""
    def release_reset_fence(self) -> int: ...
    def shutdown(self) -> None: ...
    def open_completion_channel(self, path: "os.PathLike[str] | str") -> None: ...
    def read_row(self, chunk_id: int) -> bytes: ...
    def write_row(self, chunk_id: int, data: bytes) -> None: ...
    def __enter__(self) -> "TieringManager": ...
    def __exit__(self, *exc: object) -> bool: ...

class RowMemory:
    """The memory of a granted row; numpy arrays of the row keep it (and the grant) alive."""

    __array_interface__: dict[str, Any]

class Row:
    """A held grant on one arena row (context manager)."""

    chunk_id: int
    writable: bool
    def array(self) -> Any:
        """A zero-copy numpy uint8 array over the row, valid until the row is released."""
    def tobytes(self) -> bytes: ...
    def release(self) -> None:
        """Releases the grant; raises KvtierError while an array of the row is alive."""
    def __enter__(self) -> "Row": ...
    def __exit__(self, *exc: object) -> bool:
        """Releases the grant; left by an exception, arrays still alive keep it instead of
        raising over the exception."""

class ArenaView:
    """A worker process's window on the manager's shared arena."""

    num_chunks: int
    chunk_bytes: int
    path: pathlib.Path
    fingerprint: int
    def __init__(
        self,
        path: "os.PathLike[str] | str",
        num_chunks: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
    ) -> None: ...
    row_region: tuple[int, int]
    """(address, length) of the rows, to register with a device for DMA."""
    def owner_alive(self) -> bool: ...
    def lock_memory(self) -> None: ...
    def write_row(self, chunk_id: int, data: bytes) -> None: ...
    def read_row(self, chunk_id: int) -> bytes: ...
    def row(self, chunk_id: int, write: bool = False) -> Row: ...

class WorkerReporter:
    """Reports a worker rank's finished stores on the completion channel."""

    rank: int
    def __init__(self, socket_path: "os.PathLike[str] | str", rank: int, fingerprint: int) -> None: ...
    def report(self, keys: Iterable[Key], success: bool = True) -> None: ...
    def close(self) -> None: ...
