"""The CPU-tier experts of a host, once, in shared memory: files under /dev/shm that every rank can map.

One file per MoE layer, one page-aligned slot per expert, holding the expert in tiermoe's canonical layout
(gate_up [2I, H], down [H, I], then the biases if the model has them). tmpfs files are sparse: a slot takes memory
only once written, so the files are sized for every expert while the host holds only the CPU-tier ones.
Rank 0 creates the files and reads the CPU experts from the checkpoint straight into them (torch.from_file with
shared=True maps them MAP_SHARED); other ranks of the host map the same files when they need an expert (to
promote it to their GPU), so the pages exist once whatever the number of ranks, and their proportional set size
(PSS) is split between the processes that map them. A slot whose expert left the CPU tier is released (its pages
punched out of the file). The creator removes the files when it closes, on error too; files left behind by a
process that was killed are removed by the next run that starts on the host.
With `pin` (when the ranks' GPU tiers are on CUDA) each slot a process copies to or from its GPU is page-locked
in that process with cudaHostRegister, slot by slot rather than file by file: registering a whole sparse file
would allocate all of it. Slots the loader reads for the CPU tier are locked only once a swap copies them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import secrets
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.experts.host_slab import expert_shapes, register_host, unregister_host
from tiermoe.experts.weights import ExpertWeights

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "tiermoe-experts-"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


class SharedExpertStore:
    """Expert slots in shared memory for the MoE layers of one model. Create with `create`, map with `attach`."""

    def __init__(self, directory: Path, name: str, spec, dtype: torch.dtype, owner: bool, pin: bool = False):
        if pin and not torch.cuda.is_available():
            raise TiermoeError("pinned shared expert memory needs CUDA, and CUDA is not available here")
        self.directory = Path(directory)
        self.name = name  # unique per run: FILE_PREFIX + creator pid + random token
        self.spec = spec
        self.dtype = dtype
        self.owner = owner
        self.shapes = expert_shapes(spec)
        elems = sum(_numel(s) for s in self.shapes)
        per_page = max(1, _PAGE // dtype.itemsize)
        self.slot_elems = -(-elems // per_page) * per_page  # page-aligned: releasing one never touches another
        self._maps: dict[int, torch.Tensor] = {}  # layer -> flat [E * slot_elems] view of its file
        self.pin = pin
        self._pinned: dict[tuple[int, int], int] = {}  # (layer, expert) -> registered address, this process

    # --- life cycle -------------------------------------------------------------------------------------
    @classmethod
    def create(cls, spec, dtype: torch.dtype, needed_bytes: int, directory: str | Path = SHM_DIR,
               pin: bool = False) -> SharedExpertStore:
        """A new store (files for every MoE layer, still empty); checks the host has room for `needed_bytes`.
        `pin`: page-lock the slots this process uses (needs CUDA)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise TiermoeError(f"shared memory directory '{directory}' does not exist; several ranks share their "
                               "CPU experts through tmpfs (Linux /dev/shm)")
        remove_stale_files(directory)
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if needed_bytes > free:
            gib = 1024**3
            raise TiermoeError(f"{directory} has {free / gib:.2f} GiB free but the CPU-tier experts need "
                               f"{needed_bytes / gib:.2f} GiB of shared memory; enlarge it (docker run --shm-size, "
                               f"or mount -o remount,size=... {directory}) or put more experts on the GPUs")
        name = f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        store = cls(directory, name, spec, dtype, owner=True, pin=pin)
        try:
            for layer in spec.moe_layers:
                store._map(layer)  # creates the sparse file
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def attach(cls, name: str, spec, dtype: torch.dtype, directory: str | Path = SHM_DIR,
               pin: bool = False) -> SharedExpertStore:
        """The store `name` made by another process of this host; layers are mapped on first use."""
        return cls(Path(directory), name, spec, dtype, owner=False, pin=pin)

    def path(self, layer: int) -> Path:
        return self.directory / f"{self.name}-L{layer:04d}"

    def close(self) -> None:
        """Drop this process's mappings (tensors still viewing them keep them alive); the creator removes the
        files, so the memory goes back to the host once the last mapping is gone."""
        for address in self._pinned.values():
            unregister_host(address)
        self._pinned.clear()
        self._maps.clear()
        if self.owner:
            for layer in self.spec.moe_layers:
                self.path(layer).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- slots ------------------------------------------------------------------------------------------
    def _map(self, layer: int) -> torch.Tensor:
        flat = self._maps.get(layer)
        if flat is None:
            path = self.path(layer)
            if not self.owner and not path.exists():
                raise TiermoeError(f"shared expert file {path} is missing (did rank 0 exit?)")
            size = self.spec.num_experts * self.slot_elems
            if self.owner and not path.exists():
                # sized up front: torch would extend the file by writing its last byte, which allocates a page
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size * self.dtype.itemsize)
                finally:
                    os.close(fd)
            flat = torch.from_file(str(path), shared=True, size=size, dtype=self.dtype)
            self._maps[layer] = flat
        return flat

    def slot(self, layer: int, expert: int, lock: bool = True) -> ExpertWeights:
        """Views of expert `expert`'s slot (whatever it holds: write it first). `lock`: page-lock it in this
        process if the store pins (False where no GPU copy reads it, e.g. an expert a converting backend takes)."""
        flat = self._map(layer)
        base, views = expert * self.slot_elems, []
        for shape in self.shapes:
            n = _numel(shape)
            views.append(flat[base:base + n].view(shape))
            base += n
        if lock and self.pin and (layer, expert) not in self._pinned:
            address = flat[expert * self.slot_elems:].data_ptr()
            register_host(address, self.slot_elems * self.dtype.itemsize)
            self._pinned[(layer, expert)] = address
        return ExpertWeights(*views)

    def write(self, layer: int, expert: int, weights: ExpertWeights) -> ExpertWeights:
        """Copy `weights` (host or GPU) into its slot; returns the slot's views, which now hold the expert."""
        slot = self.slot(layer, expert)
        for dst, src in zip(slot.tensors(), weights.tensors()):
            dst.copy_(src)
        return slot

    def release(self, layer: int, expert: int) -> None:
        """Give a slot's memory back to the host (the expert left the CPU tier). Best effort."""
        address = self._pinned.pop((layer, expert), None)
        if address is not None:  # unlock before the pages go: a locked page cannot be punched out
            unregister_host(address)
        offset = expert * self.slot_elems * self.dtype.itemsize
        length = self.slot_elems * self.dtype.itemsize
        if not _punch_hole(self.path(layer), offset, length):
            log.debug("could not release slot %d of layer %d (%s)", expert, layer, self.path(layer))

    def allocated_bytes(self) -> int:
        """Bytes of shared memory the files really hold (tmpfs allocates written pages only)."""
        total = 0
        for layer in self.spec.moe_layers:
            try:
                total += os.stat(self.path(layer)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total


def remove_stale_files(directory: str | Path = SHM_DIR, pid: int | None = None) -> list[Path]:
    """Remove store files whose creating process is gone (killed before it could clean up), or all files of
    process `pid` when given (its launcher reaps them). Returns the paths removed."""
    removed = []
    for path in Path(directory).glob(FILE_PREFIX + "*"):
        try:
            creator = int(path.name[len(FILE_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if (pid is not None and creator == pid) or (pid is None and not _alive(creator)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _punch_hole(path: Path, offset: int, length: int) -> bool:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if not hasattr(libc, "fallocate"):
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        return libc.fallocate(fd, mode, ctypes.c_longlong(offset), ctypes.c_longlong(length)) == 0
    finally:
        os.close(fd)
