"""How tensor-parallel ranks exchange data: three operations, two transports.

- `all_reduce_(x)`: every rank's x becomes the sum of all ranks' x (the same bits on every rank).
- `gather0(x)`: rank 0 receives every rank's x (same shape everywhere); other ranks get None.
- `broadcast0(data)`: every rank receives rank 0's bytes.

`ShmTransport` (the default where kvshare's C++ library is built) goes through a shared memory
segment (csrc/shm_collectives.cpp): a copy, a flag store and a wait, microseconds when the ranks
arrive together. `GlooTransport` uses a torch.distributed gloo process group over loopback TCP
(its device bound to 127.0.0.1, kvshare.engine.tensor_parallel.gloo_group): 1-2 ms per
all-reduce on a 2-core VM, where a sharded forward needs two per layer. Every rank
uses the same one (the engine agrees on it at start-up), and both sum in rank order, so ranks
never disagree on a result.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

from kvshare.model.kernels import shm

_FLAG_BYTES = 64  # one cache line per rank's flag word
_HEADER = 4096
# A rank waits this long for its peers before sleeping (they usually arrive within microseconds),
# and checks the awaited rank is still alive every _CHECK_MS while it waits.
_SPIN_US = 200.0
_CHECK_MS = 1000


# A segment's file name starts with this, directly in segment_dir(): the only files a worker maps.
SEGMENT_PREFIX = "kvshare-tp-"


def segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SegmentRefused(ValueError):
    """A segment a rank will not map: not one its engine could have made."""


def check_segment_path(path: str) -> None:
    """A worker maps only a file its engine could have made: a `kvshare-tp-` name directly in
    segment_dir(), so a path it is told can never name another file it could write."""
    name = os.path.basename(path)
    if os.path.normpath(path) != path or os.path.dirname(path) != segment_dir() or not name.startswith(SEGMENT_PREFIX):
        raise SegmentRefused(f"shared memory segment {path!r} is not a {SEGMENT_PREFIX}* file directly in "
                             f"{segment_dir()}")


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class GlooTransport:
    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._root = dist.BroadcastOptions()
        self._root.rootRank = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def gather0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.group.gather(outs, [x], opts).wait()
        return outs[0] if self.rank == 0 else None

    def broadcast0(self, data: bytes | None) -> bytes:
        n = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self.group.broadcast([n], self._root).wait()
        if self.rank == 0:
            if data:
                self.group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self._root).wait()
            return data
        buf = torch.empty(int(n), dtype=torch.uint8)
        if buf.numel():
            self.group.broadcast([buf], self._root).wait()
        return buf.numpy().tobytes()


class ShmSegment:
    """The mapped segment: `size` flag lines, then two banks of `size` slots of `slot_bytes`."""

    def __init__(self, path: str, size: int, slot_bytes: int, create: bool) -> None:
        self.path, self.size, self.slot_bytes = path, size, slot_bytes
        nbytes = _HEADER + 2 * size * slot_bytes
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SegmentRefused(f"shared memory segment {path} is a symbolic link") from e
            raise
        try:
            if create:
                # Allocated now, not sparse: a /dev/shm too small fails here (OSError, and the
                # engine takes gloo), never as a SIGBUS on the first write to an unbacked page.
                os.posix_fallocate(fd, 0, nbytes)
            else:
                _check_segment_file(path, os.fstat(fd), nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                os.unlink(path)  # no half-made segment left holding /dev/shm space
            raise
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.flags_ptr = self.bytes.data_ptr()
        self.banks_ptr = self.flags_ptr + _HEADER

    @staticmethod
    def slot_bytes_for(max_rows: int, hidden: int) -> int:
        """Room for one step's hidden states in float32, within 256 KiB - 4 MiB (bigger exchanges
        go in pieces): the segment is 4 slots at 2 ranks, 16 MiB at most."""
        want = max(256 << 10, min(4 << 20, max_rows * hidden * 4))
        return -(-want // 4096) * 4096

    def slot(self, seq: int, rank: int) -> torch.Tensor:
        start = _HEADER + ((seq & 1) * self.size + rank) * self.slot_bytes
        return self.bytes[start:start + self.slot_bytes]


def _check_segment_file(path: str, st: os.stat_result, nbytes: int) -> None:
    # The segment rank 0 made: this user's own regular file, of exactly the size both sides compute.
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise SegmentRefused(f"shared memory segment {path} is not a regular file of this user")
    if st.st_size != nbytes:
        raise SegmentRefused(f"shared memory segment {path} has {st.st_size} bytes, not the {nbytes} this rank "
                             "expects")


# on_late(rank) -> nonzero to give up on that rank (kvs_shm_allreduce_comm's callback).
_ON_LATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)


class ShmComm(ctypes.Structure):
    """csrc/shm_collectives.cpp's ShmComm: the segment as this rank sees it and the operation
    counter, shared by this transport and the fused decode step (which gets a pointer to it)."""

    _fields_ = [("flags", ctypes.c_void_p), ("banks", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
                ("rank", ctypes.c_int64), ("size", ctypes.c_int64), ("seq", ctypes.c_uint32), ("on_late", _ON_LATE)]


class ShmTransport:
    def __init__(self, segment: ShmSegment, rank: int, on_wait: Callable[[int], None]) -> None:
        """on_wait(rank): called each time a wait for `rank` has lasted another second; it raises
        when that rank is gone (the engine knows its worker processes, a worker its parent)."""
        self.seg, self.rank, self.size = segment, rank, segment.size
        self.on_wait = on_wait
        self._lib = shm.SHM.lib()
        self._late_error: BaseException | None = None
        self._on_late = _ON_LATE(self._late)  # kept alive as long as the struct points at it
        self.comm = ShmComm(segment.flags_ptr, segment.banks_ptr, segment.slot_bytes, rank, self.size, 0,
                            self._on_late)
        self.comm_ptr = ctypes.pointer(self.comm)

    def _late(self, rank: int) -> int:
        try:
            self.on_wait(rank)
            return 0
        except BaseException as e:  # (Ctrl+C too) a callback cannot raise into C++: kept, raised after the call
            self._late_error = e
            return 1

    def raise_late_error(self) -> None:
        """After a C++ call that all-reduced through `comm` (this transport's, or the fused decode
        step's): raise what made on_late give up, if anything did."""
        if self._late_error is not None:
            e, self._late_error = self._late_error, None
            raise e

    def _next(self) -> int:
        self.comm.seq = (self.comm.seq + 1) & 0xFFFFFFFF
        return self.comm.seq

    def _wait_all(self, seq: int) -> None:
        while (late := self._lib.kvs_shm_wait_all(self.seg.flags_ptr, self.size, seq, _SPIN_US, _CHECK_MS)) >= 0:
            self.on_wait(int(late))

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        assert x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)
        err = ctypes.create_string_buffer(256)
        rc = self._lib.kvs_shm_allreduce_comm(self.comm_ptr, x.data_ptr(), x.numel(), int(x.dtype == torch.bfloat16),
                                              err, len(err))
        self.raise_late_error()
        if rc:
            raise RuntimeError(err.value.decode(errors="replace"))
        return x

    def _exchange(self, mine: torch.Tensor | None) -> int:
        """One operation: write my bytes (if any) to my slot, post, wait for every rank."""
        seq = self._next()
        if mine is not None and mine.numel():
            self.seg.slot(seq, self.rank)[:mine.numel()].copy_(mine)
        self._lib.kvs_shm_post(self.seg.flags_ptr, self.rank, seq)
        self._wait_all(seq)
        return seq

    def gather0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        raw = _bytes_view(x)
        outs = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        for i in range(0, raw.numel(), self.seg.slot_bytes):
            part = raw[i:i + self.seg.slot_bytes]
            seq = self._exchange(part)
            if outs is not None:
                for r, out in enumerate(outs):
                    _bytes_view(out)[i:i + part.numel()].copy_(self.seg.slot(seq, r)[:part.numel()])
        return outs

    def broadcast0(self, data: bytes | None) -> bytes:
        """Rank 0's bytes after an 8-byte length, in slot-sized pieces (one piece for a step plan)."""
        slot = self.seg.slot_bytes
        if self.rank == 0:
            msg = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
            for i in range(0, msg.numel(), slot):
                self._exchange(msg[i:i + slot])
            return data
        seq = self._exchange(None)
        first = self.seg.slot(seq, 0)
        total = 8 + int.from_bytes(first[:8].numpy().tobytes(), "little")
        out = bytearray(first[8:min(slot, total)].numpy().tobytes())
        for i in range(slot, total, slot):
            seq = self._exchange(None)
            out += self.seg.slot(seq, 0)[:min(slot, total - i)].numpy().tobytes()
        return bytes(out)
