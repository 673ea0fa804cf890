"""Host KV pool: one shared-memory file per pipeline stage per node, mapped by all its TP ranks.

Lifecycle (the stage code drives the broadcast and the barrier):

    rank 0:      pool, name = HostPool.create(nbytes, tag)      # O_CREAT|O_EXCL, mode 0600
    broadcast name to the stage's other ranks on this node
    other ranks: pool = HostPool.attach(name, nbytes)
    barrier
    rank 0:      pool.unlink()       # mappings stay valid; nothing outlives a crash
    every rank:  pool.register_cuda()  # pinned for the zero-copy swap-in kernel

The name is fresh per pool (`longctx-{tag}-{pid}-{random}`), never configured. A process killed
between create and unlink leaves its file behind; `cleanup_stale` (run at every create) removes
files whose creating pid is gone, and an atexit hook unlinks what this process still owns.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass

import psutil
import torch

from longctx.errors import LongctxError

NAME_PREFIX = "longctx-"
# Files younger than this are left alone by the cleanup that runs at create time: with a shared
# /dev/shm but separate pid namespaces a live creator can look dead, and the create->unlink
# window of a healthy pool is seconds.
STALE_GRACE_S = 300.0
_TAG_RE = re.compile(r"^[A-Za-z0-9_.]+$")


class HostPoolError(LongctxError, RuntimeError):
    """The host pool file cannot be created, found, sized, mapped or registered."""


def shm_dir() -> str:
    """Directory for pool files: /dev/shm (RAM-backed) if usable, else the temp dir."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _resolve(name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(shm_dir(), name)


# Paths this process created and has not unlinked yet; unlinked at interpreter exit.
_OWNED: set[str] = set()


@atexit.register
def unlink_owned() -> None:
    """Unlink every pool file this process created and has not unlinked yet (also runs at exit)."""
    for path in list(_OWNED):
        with contextlib.suppress(OSError):
            os.unlink(path)
        _OWNED.discard(path)


def _pid_alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cleanup_stale(
    prefix: str = NAME_PREFIX,
    directory: str | None = None,
    min_age_s: float = 0.0,
    pids: Collection[int] | None = None,
) -> list[str]:
    """Remove pool files named `{prefix}...-{pid}-{hex}` whose pid is dead; returns removed paths.

    Only files owned by this user and older than `min_age_s` seconds are considered, and with
    `pids` only those these processes created (ones the caller has reaped: with no age limit,
    a file of a pid merely not seen here may belong to a live process in another pid namespace).
    """
    directory = directory or shm_dir()
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        parts = entry.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pids is not None and pid not in pids:
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - max(st.st_mtime, st.st_ctime) < min_age_s:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class HostPool:
    """A shared mmap of `nbytes` bytes, exposed as a uint8 torch tensor (`.tensor`).

    Build with `create` (one rank) or `attach` (the others). `close()` unregisters from CUDA,
    drops the mapping (once no tensor view of it is alive) and, for the creator, unlinks the
    file if that has not happened yet.
    """

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.nbytes = nbytes
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        # frombuffer over a memoryview: torch keeps the memoryview alive, which keeps the mmap
        # exported, so the mapping cannot be unmapped under a live tensor view.
        self._tensor: torch.Tensor | None = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
        self._registered = False
        self._unlinked = not owner

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def create(cls, nbytes: int, tag: str, reserve: bool = True) -> tuple[HostPool, str]:
        """Create a fresh pool file (O_EXCL, 0600) and map it; returns (pool, name to broadcast).

        `reserve` allocates the memory now (posix_fallocate), so a full /dev/shm fails here
        with a clear error instead of a SIGBUS on first touch.
        """
        if nbytes <= 0:
            raise HostPoolError(f"host pool size must be > 0 bytes, got {nbytes}")
        if not _TAG_RE.match(tag):
            raise HostPoolError(f"host pool tag {tag!r} must match [A-Za-z0-9_.]+")
        directory = shm_dir()
        cleanup_stale(NAME_PREFIX, directory, min_age_s=STALE_GRACE_S)
        path = os.path.join(directory, f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _OWNED.add(path)
        try:
            os.ftruncate(fd, nbytes)
            if reserve and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
                    raise HostPoolError(
                        f"cannot reserve {nbytes / 2**30:.2f} GiB in {directory} "
                        f"({free / 2**30:.2f} GiB free): {e.strerror}"
                    ) from None
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _OWNED.discard(path)
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the memory; no fd needs to stay open
        pool = cls(path, nbytes, mm, owner=True)
        return pool, pool.name

    @classmethod
    def attach(cls, name: str, nbytes: int) -> HostPool:
        """Map an existing pool by the name rank 0 broadcast (basename or absolute path)."""
        path = _resolve(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise HostPoolError(
                f"host pool {path} not found (unlinked before every rank attached?)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise HostPoolError(f"host pool {path} holds {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm, owner=False)

    # ---- access --------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The whole mapping as uint8 [nbytes]."""
        if self._tensor is None:
            raise HostPoolError(f"host pool {self.name} is closed")
        return self._tensor

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A `dtype` view of `shape` starting `offset` bytes into the mapping."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = itemsize
        for d in shape:
            n *= d
        if offset < 0 or offset % itemsize or offset + n > self.nbytes:
            raise HostPoolError(
                f"view of {n} bytes at offset {offset} (align {itemsize}) outside pool of {self.nbytes}"
            )
        return self.tensor[offset : offset + n].view(dtype).view(shape)

    # ---- lifecycle -----------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the file name (creator, after every rank attached); mappings stay valid."""
        if self._unlinked:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._unlinked = True
        _OWNED.discard(self.path)

    def register_cuda(self, flags: int = 0) -> bool:
        """Page-lock the mapping with cudaHostRegister; returns False (no-op) without CUDA."""
        if self._registered:
            return True
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self.data_ptr(), self.nbytes, flags)
        if int(err) != 0:
            raise HostPoolError(f"cudaHostRegister of {self.nbytes} bytes failed: {err}")
        self._registered = True
        return True

    def close(self) -> None:
        """Unregister, unlink (creator) and drop the mapping. Idempotent."""
        if self._tensor is None:
            return
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self._registered = False
        if self.owner:
            self.unlink()
        self._tensor = None
        mm, self._mm = self._mm, None
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # views are still alive; the mapping goes when the last one does

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # plain try: module globals such as contextlib may already be gone at shutdown
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"HostPool(name={self.name!r}, nbytes={self.nbytes}, owner={self.owner}, closed={self.closed})"


@dataclass(frozen=True)
class HostKVSpec:
    """Byte layout of a stage's host KV: layers [layer_start, layer_end), each a region of
    `num_slots` rows (the device pool's token rows, same slot index) of `row_bytes` bytes (one
    figure for every layer, or one per layer where layers store their KV in different kinds),
    starting `offset` bytes into the pool, regions aligned to `align` bytes."""

    layer_start: int
    layer_end: int
    num_slots: int
    row_bytes: int | tuple[int, ...]
    offset: int = 0
    align: int = 4096

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def rows_of(self, layer: int) -> int:
        """Bytes of one row of `layer`."""
        if not (self.layer_start <= layer < self.layer_end):
            raise HostPoolError(f"layer {layer} not in this stage's [{self.layer_start}, {self.layer_end})")
        rb = self.row_bytes
        return rb if isinstance(rb, int) else rb[layer - self.layer_start]

    def _region(self, layer: int) -> int:
        raw = self.num_slots * self.rows_of(layer)
        return -(-raw // self.align) * self.align

    @property
    def uniform(self) -> bool:
        rb = self.row_bytes
        return isinstance(rb, int) or len(set(rb)) <= 1

    @property
    def layer_stride(self) -> int:
        """Bytes from one layer's region to the next (every layer's rows the same size)."""
        if not self.uniform:
            raise HostPoolError(f"layers of {self} have rows of different sizes: no single stride")
        return self._region(self.layer_start)

    @property
    def nbytes(self) -> int:
        """Pool bytes needed through the end of the last layer's region."""
        return self.offset + sum(self._region(i) for i in range(self.layer_start, self.layer_end))

    def layer_offset(self, layer: int) -> int:
        self.rows_of(layer)  # (in range)
        return self.offset + sum(self._region(i) for i in range(self.layer_start, layer))

    def check(self) -> None:
        rb = self.row_bytes
        rows = [rb] if isinstance(rb, int) else list(rb)
        if isinstance(rb, tuple) and len(rb) != self.num_layers:
            raise HostPoolError(f"host KV layout {self}: {len(rb)} row sizes for {self.num_layers} layers")
        if self.num_layers <= 0 or self.num_slots <= 0 or min(rows, default=0) <= 0:
            raise HostPoolError(f"empty host KV layout {self}")


class HostKVLayout:
    """`HostKVSpec` bound to a `HostPool`: per-layer [num_slots, row bytes] uint8 views."""

    def __init__(self, pool: HostPool, spec: HostKVSpec) -> None:
        spec.check()
        if spec.nbytes > pool.nbytes:
            raise HostPoolError(f"host KV layout needs {spec.nbytes} bytes, pool has {pool.nbytes}")
        self.pool = pool
        self.spec = spec

    def layer_view(self, layer: int) -> torch.Tensor:
        """uint8 [num_slots, row bytes]: row s backs slot s of `layer` in the device pool."""
        s = self.spec
        return self.pool.as_tensor(torch.uint8, (s.num_slots, s.rows_of(layer)), s.layer_offset(layer))

    def view(self) -> torch.Tensor:
        """uint8 [num_layers, num_slots, row bytes] over all layers (layer stride may pad; rows of one
        size only)."""
        s = self.spec
        rb = s.rows_of(s.layer_start)
        return self.pool.tensor.as_strided((s.num_layers, s.num_slots, rb), (s.layer_stride, rb, 1), s.offset)
