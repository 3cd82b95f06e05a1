"""The KV tiers' bytes: blocks' KV copied between the pool's tensors, host RAM and files. What is
kept where is decided by the bookkeeping (kvshare/kvcache/kv_tiers.py); this side applies the
step plan's transfers (stores, loads, drops) and reads disk files back with validation.

A disk file is one block, named by its chain hash and KV cache group (`<hex>.g<group>.kvblock`):
a magic line, a JSON
header, then the payload (the block's K and V of every layer, then its scales when the KV is
quantized). The header holds everything that makes the KV valid for reuse: the format version,
the model file's identity, the tokenizer's and chat template's, the block size, the KV dtype and
layout, the KV cache group, the hash seed's identity, the block's hash, its parent's, its token
ids, the hash of its namespace key (never the salt), and the payload's size and checksum. A file
whose header or payload does not match is a miss, never a hit. Files are written to a temporary
name and renamed, so a crash mid-write leaves no file under a block's name.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
import uuid
from typing import Callable

import torch

logger = logging.getLogger("kvshare")

FORMAT_VERSION = 2  # 2: the KV cache group in the file's name
MAGIC = b"KVSHARE-KV-BLOCK\n"
SUFFIX = ".kvblock"


def block_file_name(key_hex: str, group: int) -> str:
    """A block file's name: its chain hash and its KV cache group (each group hashes from its own
    root, so the hash alone is unique; the group is there for operators and for the check)."""
    return f"{key_hex}.g{group}{SUFFIX}"


def parse_block_file_name(name: str) -> tuple[bytes, int] | None:
    """(hash, group) of a block file's name, or None when it is not one."""
    stem, _, group = name[:-len(SUFFIX)].rpartition(".g")
    if not name.endswith(SUFFIX) or not stem or not group.isdigit():
        return None
    try:
        return bytes.fromhex(stem), int(group)
    except ValueError:
        return None
# Header fields that say whose KV a file can be: all must equal this engine's for any hit.
IDENTITY_FIELDS = ("format", "model", "tokenizer", "block_size", "kv_dtype", "layout", "hash_seed")


def model_identity(path: str) -> str:
    """A model file's (or directory's) identity: each file's size, its first MiB (a GGUF file's
    header and metadata) and 16 evenly spread 64 KiB samples of its tensor data. Reading it all
    would cost seconds on a large model; a different file differs in its header or its data."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    h = hashlib.sha256()
    for name in files:
        size = os.path.getsize(name)
        h.update(os.path.basename(name).encode() + size.to_bytes(8, "little"))
        with open(name, "rb") as f:
            h.update(f.read(1 << 20))
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(1 << 16))
    return h.hexdigest()


def tokenizer_identity(tokenizer) -> str:
    """The vocabulary (token -> id) and the chat template: KV is keyed by token ids, so another
    tokenizer's ids mean other text."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8"))
    h.update((getattr(tokenizer, "chat_template", None) or "").encode("utf-8"))
    return h.hexdigest()


def read_header(path: str) -> tuple[dict, int]:
    """(header, payload offset) of a block file; ValueError naming what is wrong."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
            raise ValueError("not a kvshare KV block file (bad magic)")
        size = int.from_bytes(head[len(MAGIC):], "little")
        raw = f.read(size)
        if len(raw) != size:
            raise ValueError("truncated header")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("unreadable header: not an object")
    return header, len(MAGIC) + 8 + size


def read_block_file(path: str) -> tuple[dict, bytearray]:
    """(header, payload) with the payload's size and checksum verified; ValueError otherwise. The
    payload is read into a writable buffer, so the KV tensors can view it without another copy."""
    header, offset = read_header(path)
    size = header.get("payload_bytes")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"unreadable header: payload_bytes is {size!r}")
    with open(path, "rb") as f:
        f.seek(offset)
        payload = bytearray(size + 1)  # one byte more: a file longer than its header says is seen
        got = f.readinto(payload)
    if got < size:
        raise ValueError(f"truncated: payload {got} bytes, header says {size}")
    if got > size:
        raise ValueError(f"too long: the payload runs past the {size} bytes its header says")
    del payload[size:]
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
        raise ValueError("checksum: the payload does not match its checksum")
    return header, payload


@contextlib.contextmanager
def one_thread():
    """Block copies on one thread: each is a few hundred KiB of strided memcpy that a second
    thread does not speed up, and a parallel region per block costs a wake-up each, up to a
    scheduler slice when the cores are busy (measured on 2 busy cores, 50 blocks of the 1B model:
    89 ms with 2 threads, 1.7 ms with one)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class KVTierStore:
    def __init__(self, kv_cache, identity: dict, disk_path: str | None,
                 describe: Callable[[bytes], dict | None]) -> None:
        self.kv_cache = kv_cache
        self.identity = identity
        self.disk_path = disk_path
        self.describe = describe  # the bookkeeping's header fields for a kept block
        self.ram: dict[bytes, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.write_errors = 0
        self.files_written = 0
        self._write_error_logged = False

    # ---- the step plan's transfers ---------------------------------------------------------------
    def apply(self, stores: list[tuple[int, bytes]], loads: list[tuple[int, bytes]],
              drops: list[tuple[str, bytes, int]]) -> None:
        """Stores, then loads, then drops (the order kvshare/kvcache/kv_tiers.py plans for)."""
        with one_thread():
            self._apply(stores, loads, drops)

    def _apply(self, stores: list[tuple[int, bytes]], loads: list[tuple[int, bytes]],
               drops: list[tuple[str, bytes, int]]) -> None:
        for block_id, key in stores:
            self.ram[key] = self._copy_out(block_id)
            if self.disk_path is not None:
                self._write_file(key)
        for block_id, key in loads:
            data, scales = self.ram[key]
            bs = self.kv_cache.block_size
            self.kv_cache.data[..., block_id * bs:(block_id + 1) * bs, :] = data
            if scales is not None:
                self.kv_cache.scales[..., block_id * bs:(block_id + 1) * bs] = scales
        for tier, key, group in drops:
            if tier == "cpu":
                self.ram.pop(key, None)
            elif self.disk_path is not None:
                try:
                    os.remove(self.path_of(key, group))
                except OSError:
                    pass  # gone already (another engine's budget, an operator): nothing to forget

    def _copy_out(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        bs = self.kv_cache.block_size
        data = self.kv_cache.data[..., block_id * bs:(block_id + 1) * bs, :].clone()
        scales = self.kv_cache.scales
        return data, None if scales is None else scales[..., block_id * bs:(block_id + 1) * bs].clone()

    # ---- disk -------------------------------------------------------------------------------------
    def path_of(self, key: bytes, group: int) -> str:
        assert self.disk_path is not None
        return os.path.join(self.disk_path, block_file_name(key.hex(), group))

    def _payload(self, key: bytes) -> bytes:
        data, scales = self.ram[key]
        out = data.contiguous().view(torch.uint8).numpy().tobytes()
        if scales is not None:
            out += scales.contiguous().view(torch.uint8).numpy().tobytes()
        return out

    def _write_file(self, key: bytes) -> None:
        described = self.describe(key)
        if described is None:
            return  # dropped again already
        path = self.path_of(key, described["group"])
        if os.path.exists(path):
            return  # content-addressed: the same block, from a restart or another engine
        payload = self._payload(key)
        header = {**self.identity, **described, "payload_bytes": len(payload),
                  "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(raw).to_bytes(8, "little") + raw + payload)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
            self.files_written += 1
        except OSError as e:
            self.write_errors += 1
            try:
                os.remove(tmp)
            except OSError:
                pass
            if not self._write_error_logged:
                self._write_error_logged = True
                why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
                logger.warning("KV disk tier: cannot write %s (%s); the block stays in RAM only, requests are "
                               "served as before (further write errors are counted, not logged)", path, why)

    def fetch(self, key: bytes, expected: dict) -> str | None:
        """Read a block file into RAM if it is valid for `expected` (the bookkeeping's entry) and
        for this engine; None, or why it is a miss."""
        try:
            header, payload = read_block_file(self.path_of(key, expected["group"]))
        except FileNotFoundError:
            return "missing: the file was deleted"
        except (OSError, ValueError) as e:
            return str(e)
        why = self.mismatch(header)
        if why is not None:
            return why
        for name in ("hash", "parent", "tokens", "namespace", "group"):
            if header.get(name) != expected[name]:
                return f"foreign header: {name} differs from the block's"
        data, scales = self._from_payload(payload)
        if data is None:
            return "truncated: payload size does not fit the KV layout"
        self.ram[key] = (data, scales)
        return None

    def discover(self, key: bytes, group: int) -> dict | None:
        """The header of KV cache group `group`'s block file this engine's index does not list, if
        it is this engine's kind of KV (another engine with the same model, layout and hash seed
        wrote it)."""
        try:
            header, _ = read_header(self.path_of(key, group))
        except (OSError, ValueError):
            return None
        ok = self.mismatch(header) is None and header.get("hash") == key.hex() and header.get("group") == group
        return header if ok else None

    def mismatch(self, header: dict) -> str | None:
        for name in IDENTITY_FIELDS:
            if header.get(name) != self.identity[name]:
                return f"foreign header: {name} is {header.get(name)!r}, this engine's is {self.identity[name]!r}"
        return None

    def _from_payload(self, payload: bytearray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        bs = self.kv_cache.block_size
        like = self.kv_cache.data[..., 0:bs, :]
        n = like.numel() * like.element_size()
        scales_like = None if self.kv_cache.scales is None else self.kv_cache.scales[..., 0:bs]
        m = 0 if scales_like is None else scales_like.numel() * scales_like.element_size()
        if len(payload) != n + m:
            return None, None
        buf = torch.frombuffer(payload, dtype=torch.uint8)
        data = buf[:n].view(like.dtype).view(like.shape)
        scales = None if scales_like is None else buf[n:].view(scales_like.dtype).view(scales_like.shape)
        return data, scales

    def scan(self) -> tuple[list[tuple[bytes, dict]], int]:
        """The directory's files valid for this engine, oldest first (header only), and how many
        others it holds (another model, dtype, block size, hash seed, or unreadable)."""
        assert self.disk_path is not None
        found, foreign = [], 0
        for name in os.listdir(self.disk_path):
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.disk_path, name)
            named = parse_block_file_name(name)
            try:
                header, _ = read_header(path)
                mtime = os.path.getmtime(path)
            except (OSError, ValueError):
                foreign += 1
                continue
            if (named is None or self.mismatch(header) is not None or header.get("hash") != named[0].hex()
                    or header.get("group") != named[1]):
                foreign += 1
                continue
            found.append((mtime, named[0], header))
        found.sort(key=lambda t: t[0])
        return [(key, header) for _, key, header in found], foreign

    def clear_disk(self) -> int:
        """Remove every block file (a tier without a hash seed is this process's only)."""
        assert self.disk_path is not None
        removed = 0
        for name in os.listdir(self.disk_path):
            if name.endswith(SUFFIX):
                try:
                    os.remove(os.path.join(self.disk_path, name))
                    removed += 1
                except OSError:
                    pass
        return removed

    def file_bytes(self) -> int:
        """About one block file's size (payload plus a header): what the disk budget is divided by."""
        bs = self.kv_cache.block_size
        n = self.kv_cache.data[..., 0:bs, :].numel() * self.kv_cache.data.element_size()
        if self.kv_cache.scales is not None:
            n += self.kv_cache.scales[..., 0:bs].numel() * self.kv_cache.scales.element_size()
        return n + 1024 + 8 * bs


def probe_tier_loads(store: KVTierStore, runner, repeats: int = 3) -> dict:
    """Seconds to recompute one block of tokens (a prefill of block_size tokens into pool blocks
    0 .. G-1, one per KV cache group, free at start-up, zeroed again after), to load it (its G
    blocks) from host RAM, and from disk (G probe files written, read back with validation,
    removed; None without a disk tier): medians of `repeats`."""
    from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan

    kv, bs = store.kv_cache, store.kv_cache.block_size
    groups = range(len(runner.group_policies))
    access = tuple(GroupAccess([g * bs + p for p in range(bs)], [g], None) for g in groups)
    chunk = ChunkPlan("kv-tier-probe", 0, list(range(100, 100 + bs)), 0, access, False)
    keys = [hashlib.sha256(b"kvshare-tier-probe" + uuid.uuid4().bytes).digest() for _ in groups]
    loads = [(g, keys[g]) for g in groups]

    def median(fn) -> float:
        fn()  # warm-up: first-touch pages, kernel threads
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    out: dict = {"recompute": median(lambda: runner.execute(StepPlan(chunks=[chunk])))}
    for g in groups:
        store.ram[keys[g]] = store._copy_out(g)
    out["ram"] = median(lambda: store.apply([], loads, []))
    out["disk"] = None
    if store.disk_path is not None:
        expected = {k: {"hash": k.hex(), "parent": None, "tokens": chunk.token_ids, "namespace": "probe", "group": g}
                    for g, k in enumerate(keys)}
        describe, store.describe = store.describe, expected.get
        try:
            for k in keys:
                store._write_file(k)

            def from_disk() -> None:
                if any(store.fetch(k, expected[k]) is not None for k in keys):
                    raise OSError("a probe block did not read back")
                store.apply([], loads, [])

            out["disk"] = median(from_disk)
        except OSError:
            out["disk"] = float("inf")  # unwritable or unreadable: no faster than anything
        finally:
            store.describe = describe
            store.files_written = store.write_errors = 0
            store._write_error_logged = False
            for g, k in enumerate(keys):
                try:
                    os.remove(store.path_of(k, g))
                except OSError:
                    pass
    for k in keys:
        store.ram.pop(k, None)
    kv.data[..., 0:len(groups) * bs, :] = 0  # as a new pool: blocks 0 .. G-1 are free
    if kv.scales is not None:
        kv.scales[..., 0:len(groups) * bs] = 0
    return out
