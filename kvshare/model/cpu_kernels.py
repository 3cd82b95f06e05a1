"""Optional C++ CPU kernels: plain C ABI shared libraries, compiled with a direct compiler call
into a per-user cache and called through ctypes. Sources live in `kvshare/model/csrc/`.

Libraries (`LIBRARIES`):

* `ATTENTION` (csrc/paged_attention.cpp): `paged_decode_attention` computes attention for
  decode rows (one query per sequence) straight from the paged KV cache: each (row, kv head)
  task walks its own block table, reads every K and V vector of its context exactly once, and
  keeps an online softmax with float32 accumulation. No padded gather, no score matrix in
  memory. GQA/MQA/MHA, float32 or bfloat16 queries; float32, bfloat16 or float16 caches, or
  int8 / float8 e4m3 caches with one scale per (kv head, slot) (applied to the scores and the
  probabilities, not per element); any block size >= 1, any head_dim. Code paths, picked at run
  time by CPU features: AVX-512 for head_dim <= 128, plus vdpbf16ps dot products where the CPU
  has AVX512_BF16 and both q and the cache are bfloat16; AVX2 + FMA (+ F16C) for any head_dim
  (and where AVX-512 does not fit); a portable scalar path everywhere else.
  Rows are spread over torch's thread count with OpenMP (the libgomp torch already loaded),
  longest first; each (row, kv head) is computed by one thread, so results do not depend on the
  thread count.
* `QMATMUL` (csrc/qmatmul.cpp): `int8_group_matmul` / `int4_group_matmul`, x [M, K] times a
  group-quantized weight [N, K] of int8 codes, or of 4-bit codes packed two per byte
  (`pack_int4_rows`), with one float32 scale, and optionally a zero, per group of K; for small M.
  On AVX-512 VNNI CPUs weights can be kept in VNNI blocks (`to_vnni_blocks`, `VnniBlocks.matmul`):
  x rounded to int16 per group, exact int32 group sums.
* `DECODE` (qmatmul.cpp + paged_attention.cpp + shm_collectives.cpp + csrc/decode_step.cpp, one
  translation unit): `kvs_decode_layers` runs every layer of a decode-only step in one call on the
  two kernels above (kvshare/model/fused_decode.py says when it applies and builds its
  arguments), with tensor parallelism's all-reduces between them when it is given the ranks'
  shared memory.
* `SHM` (csrc/shm_collectives.cpp): all-reduce and flag waits between tensor-parallel ranks
  through a shared memory segment (kvshare/model/tp_transport.py). Linux only (futex).

Building never makes a request wait:

* `available()` (per library; the module-level one is the attention library's) never blocks on
  a compiler. It is True when the library is loaded, or when a cached build exists and loads
  (milliseconds: one `c++ --version` and a dlopen). Otherwise it starts one background thread
  that compiles the library and answers False until that finishes. Callers on the serving path
  just ask again later (it is cheap once decided).
* `wait_until_built(timeout=None)` blocks until the build is done (tests, benchmarks, setup);
  `python -m kvshare.model.cpu_kernels --build` prebuilds every library (`make setup`).
* The compiler is `$CXX` if set, else `c++` or `g++` from PATH, run as
  `c++ -O3 -fopenmp -fno-math-errno -shared -fPIC src -o lib` (no -march: the code picks its
  paths with target attributes and runtime CPU checks). The output lands in
  `$KVSHARE_CACHE_DIR` (default ~/.cache/kvshare/kernels), never in the source tree, named by a
  hash of the source text, the flags and the compiler's version string. It is compiled in a
  private temp dir and renamed into place atomically: concurrent processes need no lock (at
  worst both compile and the second rename wins, with identical content).
* Nothing here raises at import. A failure (no compiler, compile error, non-POSIX, unwritable
  cache) makes `available()` False, with the reason logged once at INFO and returned by
  `unavailable_reason()`; it is not retried in this process.

Set KVSHARE_DISABLE_CPP_KERNELS=1 to force the pure-PyTorch paths (`available()` is then False;
the kernels themselves still run when called directly).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("kvshare")

DISABLE_ENV = "KVSHARE_DISABLE_CPP_KERNELS"
CACHE_ENV = "KVSHARE_CACHE_DIR"
CSRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# libgomp: the library links the system libgomp.so.1, whose soname matches the copy torch has
# already loaded, so there is one OpenMP runtime and one thread pool.
CXXFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 900


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def cache_dir() -> str:
    """Where built libraries go: $KVSHARE_CACHE_DIR, else ~/.cache/kvshare/kernels."""
    d = os.environ.get(CACHE_ENV, "").strip()
    return os.path.abspath(os.path.expanduser(d)) if d else os.path.join(
        os.path.expanduser("~"), ".cache", "kvshare", "kernels")


def _compiler_cmd() -> list[str] | None:
    """$CXX (may carry a wrapper, e.g. "ccache g++"; must resolve), else c++ or g++ from PATH."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        parts = shlex.split(cxx)
        exe = shutil.which(parts[0])
        return [exe, *parts[1:]] if exe else None
    exe = shutil.which("c++") or shutil.which("g++")
    return [exe] if exe else None


def find_compiler() -> str | None:
    """The C++ compiler the kernels would be built with, or None when there is none."""
    cmd = _compiler_cmd()
    return None if cmd is None else " ".join(cmd)


_versions: dict[tuple[str, ...], str] = {}
_versions_lock = threading.Lock()


def _compiler_version(cmd: list[str]) -> str:
    key = tuple(cmd)
    with _versions_lock:
        if key not in _versions:
            try:
                res = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as e:
                raise RuntimeError(f"C++ compiler {' '.join(cmd)!r} does not run: {e}") from e
            if res.returncode != 0 or not res.stdout.strip():
                raise RuntimeError(f"C++ compiler {' '.join(cmd)!r} does not run: `--version` exited "
                                   f"{res.returncode}: {(res.stderr or res.stdout).strip()[:300]}")
            _versions[key] = res.stdout.strip()
        return _versions[key]


def _summary(msg: str) -> str:
    """A compiler log's first line and its last informative one (the error itself)."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return msg[:500]
    return f"{lines[0][:300]} ... {lines[-1][:300]}"


class KernelLibrary:
    """C++ source files built, as one translation unit, into one shared library, loaded at most
    once per process."""

    def __init__(self, name: str, sources: str | tuple[str, ...], setup: Callable[[ctypes.CDLL], None]) -> None:
        self.name = name
        # File names under CSRC_DIR, concatenated in this order (a later file may call what an
        # earlier one defines); the last one names the compiled file.
        self.sources = (sources,) if isinstance(sources, str) else tuple(sources)
        self.source = self.sources[-1]
        self._setup = setup  # declares the C signatures
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._t0: float | None = None
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None
        self._seconds: float | None = None
        self._from_cache: bool | None = None
        self._path: str | None = None

    # -- state ------------------------------------------------------------------------------
    def available(self) -> bool:
        """Non-blocking. True when loaded (a cached build is loaded on the spot); otherwise
        starts the background build once and returns False until it has finished. False when
        disabled by KVSHARE_DISABLE_CPP_KERNELS=1 (then nothing is built)."""
        if disabled_by_env():
            return False
        if self._lib is not None:
            return True
        if not self._started:
            self._start()
        return self._lib is not None

    def wait_until_built(self, timeout: float | None = None) -> bool:
        """Blocking: build (or load) the library, waiting up to `timeout` seconds (None: for
        as long as it takes). True when it is loaded. Builds even when disabled by the
        environment variable (prebuilding); `available()` still says False then."""
        self._start()
        self._done.wait(timeout)
        return self._lib is not None

    def is_done(self) -> bool:
        """The build (or cached load) has finished, successfully or not."""
        return self._done.is_set()

    def unavailable_reason(self) -> str | None:
        """Why `available()` is False (disabled, still building, or the failure), else None."""
        if disabled_by_env():
            return f"disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
        if not self._started:
            self._start()
        if self._lib is not None:
            return None
        if not self._done.is_set():
            return f"still building in the background ({time.perf_counter() - (self._t0 or 0.0):.0f} s so far)"
        return self._error or "build failed"

    def build_seconds(self) -> float | None:
        """Wall time of this process's compile, or of loading the cached build; None until done."""
        return self._seconds

    def from_cache(self) -> bool | None:
        """True when a cached build was loaded, False when this process compiled it."""
        return self._from_cache

    def path(self) -> str | None:
        """The loaded shared library's path."""
        return self._path

    def lib(self) -> ctypes.CDLL:
        """The loaded library, building it first if needed (blocking)."""
        if self._lib is None and not self.wait_until_built():
            raise RuntimeError(f"C++ CPU kernels ({self.name}) unavailable: {self._error}")
        return self._lib  # type: ignore[return-value]

    # -- build ------------------------------------------------------------------------------
    def _start(self) -> None:
        """Once per process: load the cached build right here if there is one, else start the
        background compile. The lock only covers this fast part."""
        if self._started:
            return
        with self._lock:
            if self._started:
                return
            self._started = True
            self._t0 = t0 = time.perf_counter()
            try:
                if os.name != "posix":
                    raise RuntimeError(f"C++ kernels are only built on POSIX systems (os.name={os.name!r})")
                cmd = _compiler_cmd()
                if cmd is None:
                    cxx = os.environ.get("CXX", "").strip()
                    raise RuntimeError(f"no C++ compiler found: CXX={cxx!r} does not resolve" if cxx else
                                       "no C++ compiler found: neither c++ nor g++ is on PATH (install g++ or set CXX)")
                text = ""
                for name in self.sources:
                    with open(os.path.join(CSRC_DIR, name), encoding="utf-8") as f:
                        text += f"// ---- {name} ----\n" + f.read() + "\n"
                key = "\0".join([text, " ".join(CXXFLAGS), _compiler_version(cmd)])
                digest = hashlib.sha256(key.encode()).hexdigest()[:16]
                path = os.path.join(cache_dir(), f"kvshare_{self.name}_{digest}.so")
            except Exception as e:  # noqa: BLE001 - any failure just means "not available"
                self._finish(None, e, t0, cached=False)
                return
            if os.path.isfile(path):
                try:
                    self._finish(self._open(path), None, t0, cached=True, path=path)
                    return
                except Exception as e:  # noqa: BLE001 - unloadable cached file: build it again
                    logger.debug("kvshare: cached %s does not load (%s); rebuilding", path, e)
            try:
                threading.Thread(target=self._compile_and_load, args=(cmd, text, path, t0),
                                 name=f"kvshare-build-{self.name}", daemon=True).start()
            except Exception as e:  # noqa: BLE001 - e.g. no threads left: never leave waiters hanging
                self._finish(None, e, t0, cached=False)

    def _open(self, path: str) -> ctypes.CDLL:
        lib = ctypes.CDLL(path)  # ctypes releases the GIL during calls
        self._setup(lib)
        return lib

    def _compile_and_load(self, cmd: list[str], text: str, path: str, t0: float) -> None:
        try:
            _compile(cmd, text, self.source, path)
            lib = self._open(path)
        except Exception as e:  # noqa: BLE001
            self._finish(None, e, t0, cached=False)
        else:
            self._finish(lib, None, t0, cached=False, path=path)

    def _finish(self, lib: ctypes.CDLL | None, err: Exception | None, t0: float, cached: bool,
                path: str | None = None) -> None:
        self._seconds = time.perf_counter() - t0
        self._from_cache = cached
        self._path = path
        if lib is not None:
            self._lib = lib
            logger.debug("kvshare C++ kernels %s ready in %.3f s (%s): %s", self.name, self._seconds,
                         "cached" if cached else "compiled", path)
        else:
            self._error = f"{type(err).__name__}: {err}".strip()
            logger.info("kvshare C++ kernels %s unavailable, using the pure-PyTorch path: %s", self.name,
                        _summary(self._error))
        self._done.set()


def _remove_stale_builds(out_dir: str, max_age_s: float = 3600.0) -> None:
    """Temp dirs left by processes that exited mid-compile (the build thread is a daemon)."""
    now = time.time()
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return
    for e in entries:
        try:
            if e.name.startswith(".build-") and e.is_dir() and now - e.stat().st_mtime > max_age_s:
                shutil.rmtree(e.path, ignore_errors=True)
        except OSError:
            pass


def _compile(cmd: list[str], text: str, source_name: str, path: str) -> None:
    """Compile `text` into `path`, atomically: a private temp dir next to it, then a rename."""
    out_dir = os.path.dirname(path)
    os.makedirs(out_dir, exist_ok=True)
    _remove_stale_builds(out_dir)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=out_dir)
    try:
        src = os.path.join(tmp, source_name)
        with open(src, "w", encoding="utf-8") as f:  # exactly the hashed text
            f.write(text)
        so = os.path.join(tmp, os.path.basename(path))
        argv = [*cmd, *CXXFLAGS, src, "-o", so]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, cwd=tmp)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"compiling {source_name} failed: {' '.join(argv)}: {e}") from e
        if res.returncode != 0 or not os.path.isfile(so):
            log = (res.stderr or res.stdout).strip()
            raise RuntimeError(f"compiling {source_name} failed (exit {res.returncode}): {' '.join(argv)}\n{log[-4000:]}")
        os.chmod(so, 0o755)
        os.replace(so, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- library signatures --------------------------------------------------------------------
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_attention(lib: ctypes.CDLL) -> None:
    lib.kvs_cpu_paths.restype = _int
    lib.kvs_cpu_paths.argtypes = []
    f = lib.kvs_paged_decode_attention
    f.restype = _int
    f.argtypes = [_ptr, _i64, _i64, _int,  # q
                  _ptr, _i64, _i64, _ptr, _i64, _i64, _int,  # k, v, cache kind
                  _ptr, _i64, _ptr, _i64,  # k scales, v scales (null for float caches)
                  _ptr, _i64, _ptr,  # tables, max_blocks, context lengths
                  _ptr, _ptr,  # per-row sink end, window start (null: every position visible)
                  _ptr, _i64, _i64,  # out
                  _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_double,  # n, H, KVH, D, block_size, num_blocks, scale
                  _int, _int, ctypes.c_char_p, _i64]  # impl, threads, error buffer
    f = lib.kvs_causal_prefill_attention
    f.restype = _int
    f.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64,  # q, k, v, out and their position strides
                  _i64, _i64, _i64, _i64, ctypes.c_double,  # T, H, KVH, D, scale
                  _int, ctypes.c_char_p, _i64]  # threads, error buffer


def _setup_qmatmul(lib: ctypes.CDLL) -> None:
    lib.kvs_qmm_cpu_paths.restype = _int
    lib.kvs_qmm_cpu_paths.argtypes = []
    for f in (lib.kvs_int8_group_matmul, lib.kvs_int4_group_matmul):
        f.restype = _int
        f.argtypes = [_ptr, _i64, _int,  # x, its row stride, bf16?
                      _ptr, _ptr, _ptr,  # q (int8, or packed 4-bit), scales, zeros (null: none)
                      _ptr, _i64,  # y, its row stride
                      _i64, _i64, _i64, _i64,  # M, N, K, group_size
                      _int, _int, ctypes.c_char_p, _i64,  # impl, threads, error buffer
                      _int]  # weights in VNNI blocks?
    f = lib.kvs_group_dequantize
    f.restype = _int
    f.argtypes = [_ptr, _int, _ptr, _ptr, _ptr, _int,  # q, 4-bit?, scales, zeros, out, out bf16?
                  _i64, _i64, _i64, _int, _int]  # N, K, group_size, threads, VNNI blocks?
    lib.kvs_qmm_vnni_blocks_fit.restype = _int
    lib.kvs_qmm_vnni_blocks_fit.argtypes = [_i64, _i64]


def _setup_decode(lib: ctypes.CDLL) -> None:
    f = lib.kvs_decode_layers
    f.restype = _int
    f.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr,  # model, h, M, cos, signed sin
                  _ptr, _ptr, _i64, _ptr,  # slots, tables, max_blocks, context lengths
                  _int, ctypes.c_char_p, _i64]  # threads, error buffer


def _setup_shm(lib: ctypes.CDLL) -> None:
    lib.kvs_shm_post.restype = None
    lib.kvs_shm_post.argtypes = [_ptr, _i64, ctypes.c_uint32]  # flags, rank, seq
    lib.kvs_shm_wait_all.restype = _i64
    lib.kvs_shm_wait_all.argtypes = [_ptr, _i64, ctypes.c_uint32, ctypes.c_double, _i64]  # + spin_us, timeout_ms
    lib.kvs_shm_allreduce_comm.restype = _int
    lib.kvs_shm_allreduce_comm.argtypes = [_ptr, _ptr, _i64, _int, ctypes.c_char_p, _i64]  # comm, x, n, bf16?, error


ATTENTION = KernelLibrary("paged_attention", "paged_attention.cpp", _setup_attention)
QMATMUL = KernelLibrary("qmatmul", "qmatmul.cpp", _setup_qmatmul)
DECODE = KernelLibrary("decode_step", ("qmatmul.cpp", "paged_attention.cpp", "shm_collectives.cpp", "decode_step.cpp"),
                       _setup_decode)
# Tensor-parallel collectives over shared memory (kvshare/model/tp_transport.py).
SHM = KernelLibrary("shm_collectives", "shm_collectives.cpp", _setup_shm)
LIBRARIES = (ATTENTION, QMATMUL, DECODE, SHM)


# ---- the attention library's state, module level (kept for existing callers) ----------------
def available() -> bool:
    """Non-blocking: the paged-attention kernel is loaded and not disabled (see
    `KernelLibrary.available`: the first call loads a cached build or starts the build)."""
    return ATTENTION.available()


def wait_until_built(timeout: float | None = None) -> bool:
    """Blocking: build or load the paged-attention kernel; True when loaded."""
    return ATTENTION.wait_until_built(timeout)


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None when it is True."""
    return ATTENTION.unavailable_reason()


def build_seconds() -> float | None:
    """Wall time of the attention kernel's build (or of loading its cached build) in this process."""
    return ATTENTION.build_seconds()


def start_background_builds() -> None:
    """Non-blocking: load every cached library, start building the missing ones."""
    if not disabled_by_env():
        for lib in LIBRARIES:
            lib.available()


# OpenMP 5.0's omp_pause_resource_all(omp_pause_soft): ends the calling thread's worker threads.
_OMP_PAUSE_SOFT = 1


def release_openmp_workers() -> bool:
    """End the calling thread's OpenMP worker threads (libgomp's, which torch and these kernels
    share); True if a loaded libgomp did. Call it from a thread that is done computing when
    another thread takes over, as the server's event loop does once the engine thread starts:
    libgomp keeps one team of workers per thread that ever ran a parallel region, and once a
    process holds more workers than CPUs it stops letting idle workers spin between regions,
    so the stepping thread's workers sleep and are woken hundreds of times a step (the bundled
    model decoding in a second thread after the first built it: 12.6 against 8.6 ms/token, its
    worker busy 57% of the time; after this call in the first thread, 8.7 ms at 99%). A team
    the thread needs later is made again, of the size torch set (the pause keeps it). No-op
    (False) where libgomp is not loaded. (GNU libgomp's pause ends the calling thread's workers
    only; LLVM's libomp, shipped under the same name by some distributions, ends every
    thread's.)"""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # only the copy already loaded
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    return pause(_OMP_PAUSE_SOFT) == 0


def _lib() -> ctypes.CDLL:
    return ATTENTION.lib()


_IMPLS = {"auto": 0, "scalar": 1, "avx512": 2, "avx512bf16": 3, "avx2": 4}


def _paths(lib: ctypes.CDLL) -> list[str]:
    mask = lib.kvs_cpu_paths()
    return [name for name, bit in (("scalar", 1), ("avx2", 8), ("avx512", 2), ("avx512bf16", 4)) if mask & bit]


def cpu_paths() -> list[str]:
    """Code paths the kernel can run on this CPU, slowest first ("auto" uses the last):
    "scalar" always; "avx2" (AVX2 + FMA + F16C, any head_dim); "avx512" (AVX-512 F/BW/VL/DQ,
    head_dim <= 128, else it falls back to "avx2"); "avx512bf16" (also AVX512_BF16: used when
    both the cache and q are bfloat16)."""
    return _paths(_lib())


_DTYPES = (torch.float32, torch.bfloat16)
# Cache storage dtypes -> the kernel's cache_kind; int8 and float8 come with per-slot scales.
_CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_SCALED_KINDS = (3, 4)


def causal_prefill_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `causal_prefill_attention` takes these (v laid out as k): float32, head_dim % 64 ==
    0, contiguous heads and head_dim, an AVX-512 CPU (the library's avx512 path)."""
    return (q.dtype == torch.float32 and k.dtype == torch.float32 and q.shape[-1] % 64 == 0
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k))
            and "avx512" in cpu_paths())


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk from position 0 over its own keys: q [T, H, D], k and v
    [T, KVH, D] (H % KVH == 0, D % 64 == 0), float32, heads and head_dim contiguous (any position
    stride). Position t attends to keys 0 .. t. Returns [T, H, D] (into `out` when given: the
    same layout rules). Skips the hidden keys in tiles of 64 (torch's CPU SDPA computes them
    below 512 keys): csrc/paged_attention.cpp. Raises ValueError on bad arguments."""
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor [T, heads, D]; got {_desc(t)}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must have contiguous heads and head_dim; got strides {t.stride()}")
    n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or h % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, KVH, D] for q {tuple(q.shape)}")
    if out is None:
        out = torch.empty(n, h, d)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}; got {tuple(out.shape)}")
    err = ctypes.create_string_buffer(256)
    rc = _lib().kvs_causal_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                             v.stride(0), out.data_ptr(), out.stride(0), n, h, k.shape[1], d,
                                             scale, torch.get_num_threads(), err, len(err))
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, *, out: torch.Tensor | None = None, impl: str = "auto",
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           sink_end: torch.Tensor | None = None,
                           window_start: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per row over that row's paged context.

    q [n, H, D]; k_cache, v_cache [KVH, num_blocks * block_size, D] (H % KVH == 0); block_tables
    [n, max_blocks] (int64 or int32; entries past a row's last needed block are never read, nor
    checked); context_lens [n]: row r attends to positions 0 .. context_lens[r] - 1, position p
    living in slot block_tables[r, p // block_size] * block_size + p % block_size. Returns
    [n, H, D] in q's dtype (written into `out` when given). float32 or bfloat16 q; float32,
    bfloat16 or float16 caches, or int8 / float8_e4m3fn caches with float32 `k_scale`, `v_scale`
    [KVH, slots] (stored value x its slot's scale); float32 math. `impl` forces one of
    `cpu_paths()` (for tests).
    Bounded-KV policies pass `sink_end` and `window_start` ([n] integers, both or either): row r
    then sees positions [0, sink_end[r]) and [window_start[r], context_lens[r]) only (a sliding
    window: sink_end 0; attention sinks: the sinks, then the recent window); table entries of
    blocks wholly between the two are never read, nor checked.
    Raises ValueError on inconsistent inputs or a block id outside the cache.
    """
    lib = ATTENTION.lib()
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [n, H, D] and caches [KVH, slots, D]; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    n, heads, dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    if k_cache.shape[2] != dim or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head_dim must match "
                         f"and heads must be a multiple of kv_heads")
    if q.dtype not in _DTYPES or k_cache.dtype not in _CACHE_KINDS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; want q float32 "
                         f"or bfloat16, caches one of {sorted(str(d) for d in _CACHE_KINDS)}, k and v alike")
    kind = _CACHE_KINDS[k_cache.dtype]
    if kind in _SCALED_KINDS:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or tuple(sc.shape) != (kv_heads, slots) or sc.dtype != torch.float32:
                raise ValueError(f"{k_cache.dtype} caches need {name} float32 [{kv_heads}, {slots}]; got "
                                 f"{None if sc is None else (tuple(sc.shape), sc.dtype)}")
        k_scale = k_scale if k_scale.stride(1) == 1 else k_scale.contiguous()
        v_scale = v_scale if v_scale.stride(1) == 1 else v_scale.contiguous()
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{k_cache.dtype} caches take no scales")
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("CPU tensors only")
    block_size = int(block_size)
    if block_size < 1 or slots % block_size:
        raise ValueError(f"block_size={block_size} must be >= 1 and divide the cache's {slots} slots")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or tuple(context_lens.shape) != (n,):
        raise ValueError(f"want block_tables [n, max_blocks] and context_lens [n] for n={n}; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if block_tables.is_floating_point() or context_lens.is_floating_point():
        raise ValueError("block_tables and context_lens must be integer tensors")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(2) != 1:
        v_cache = v_cache.contiguous()
    tables = block_tables.to(device="cpu", dtype=torch.int64).contiguous()
    ctx = context_lens.to(device="cpu", dtype=torch.int64).contiguous()
    ranges = []
    for name, r in (("sink_end", sink_end), ("window_start", window_start)):
        if r is not None and (tuple(r.shape) != (n,) or r.is_floating_point()):
            raise ValueError(f"{name} must be an integer tensor [{n}]; got {_desc(r)}")
        ranges.append(None if r is None else r.to(device="cpu", dtype=torch.int64).contiguous())
    if out is None:
        out = torch.empty(n, heads, dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device.type != "cpu" or out.stride(2) != 1:
        raise ValueError("out must be a CPU tensor shaped and typed like q, with unit last stride")
    if n == 0:
        return out
    err = ctypes.create_string_buffer(256)
    rc = lib.kvs_paged_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), q.dtype == torch.bfloat16,
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), kind,
        k_scale.data_ptr() if k_scale is not None else None, k_scale.stride(0) if k_scale is not None else 0,
        v_scale.data_ptr() if v_scale is not None else None, v_scale.stride(0) if v_scale is not None else 0,
        tables.data_ptr(), tables.shape[1], ctx.data_ptr(),
        *(None if r is None else r.data_ptr() for r in ranges),
        out.data_ptr(), out.stride(0), out.stride(1),
        n, heads, kv_heads, dim, block_size, slots // block_size, float(scale),
        _IMPLS[impl], torch.get_num_threads(), err, len(err))
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out


# ---- group-quantized int8 / int4 matmul ------------------------------------------------------
_QMM_IMPLS = {"auto": 0, "scalar": 1, "avx512": 2, "avx2": 3, "avx512-vnni": 4}


def qmatmul_paths() -> list[str]:
    """Code paths `int8_group_matmul` and `int4_group_matmul` can run on this CPU, slowest first
    ("auto" uses the last one for rows that fits the group size): "scalar" always (any group size);
    "avx2" (AVX2 + FMA; group_size % 8 == 0 for int8, % 16 for int4); "avx512" (AVX-512
    F/BW/VL/DQ; group_size % 16 == 0 for int8, % 32 for int4); "avx512-vnni" (AVX-512 VNNI),
    which reads weights in VNNI blocks only (`VnniBlocks.matmul`), never weights in rows."""
    mask = QMATMUL.lib().kvs_qmm_cpu_paths()
    return [name for name, bit in (("scalar", 1), ("avx2", 4), ("avx512", 2), ("avx512-vnni", 8)) if mask & bit]


def int8_group_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_size: int, out: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """y = x @ w.T for a group-quantized weight w[n, k] = q[n, k] * scales[n, k // g]
    (+ zeros[n, k // g]), g = group_size, with float32 accumulation.

    x [M, K] float32 or bfloat16 (unit last stride, any row stride); q int8 [N, K], scales and
    zeros float32 [N, K // g], contiguous; K % g == 0. Returns [M, N] in x's dtype (written into
    `out` when given: [M, N], x's dtype, unit last stride). Made for small M (decode batches).
    The AVX-512 path takes g % 16 == 0 (16, 32, 64, ...), AVX2 g % 8 == 0, the scalar path any
    g; `impl` forces one of `qmatmul_paths()` but "avx512-vnni", which reads VNNI blocks only
    (for tests; a vector path that does not fit g falls back to the next one that does). Blocks until the library is built if it is not yet
    (check `QMATMUL.available()` first on a serving path). Raises ValueError on bad arguments.
    """
    _check_x(x)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor [N, K]; got {_desc(q)}")
    if q.shape[1] != x.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit x {tuple(x.shape)}: want q [N, {x.shape[1]}]")
    return _group_matmul("kvs_int8_group_matmul", x, "q", q, scales, zeros, group_size, out, impl)


def int4_group_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_size: int, out: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """y = x @ w.T for a group-quantized 4-bit weight w[n, k] = q[n, k] * scales[n, k // g]
    (+ zeros[n, k // g]), g = group_size, unsigned codes q in 0..15, float32 accumulation.

    Layout of `packed`: uint8 [N, K // 2], contiguous (K even), two codes per byte, in order
    along the row: byte j of row n holds q[n, 2j] in its low nibble (bits 0..3) and q[n, 2j + 1]
    in its high nibble (bits 4..7), i.e. packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4
    (`pack_int4_rows(q)` builds it, `unpack_int4_rows` inverts it). Read as a little-endian
    stream of 4-bit fields, code k is field k of the row. This is not GGUF's Q4_0 / Q4_1 block
    order (there a 32-code block's 16 bytes hold codes 0..15 in the low nibbles and 16..31 in
    the high ones): repack GGUF codes with `pack_int4_rows(unpacked codes)`. (The vector paths
    widen one byte per int32 lane and multiply the low and high nibbles by x's even and odd
    columns, from a copy of x reordered once per call, so this layout costs them nothing.)

    Everything else as `int8_group_matmul`: x [M, K] float32 or bfloat16 (unit last stride, any
    row stride), scales and zeros float32 [N, K // g] contiguous, K % g == 0; returns [M, N] in
    x's dtype (or writes `out`); float32 accumulation; a row's result does not depend on the
    other rows, the thread count or N. The AVX-512 path takes g % 32 == 0, AVX2 g % 16 == 0
    (every GGUF 4-bit format's g = 32 runs on both), the scalar path any g dividing K; `impl`
    forces one of `qmatmul_paths()` but "avx512-vnni" (a vector path that does not fit g falls
    back to the next one that does). Zeros are folded into each dequantized weight (one fma), as in the int8
    kernel. Blocks until the library is built. Raises ValueError on bad arguments, naming the
    argument.
    """
    _check_x(x)
    k = x.shape[1]
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [N, K // 2]; got {_desc(packed)}")
    if k % 2:
        raise ValueError(f"x has K={k} columns: packed 4-bit rows need an even K")
    if packed.shape[1] * 2 != k:
        raise ValueError(f"packed {tuple(packed.shape)} does not fit x {tuple(x.shape)}: want packed [N, {k // 2}]")
    return _group_matmul("kvs_int4_group_matmul", x, "packed", packed, scales, zeros, group_size, out, impl)


def group_dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     out: torch.Tensor, int4: bool) -> torch.Tensor:
    """The dense weights of int8 codes q [N, K] (int4=False) or packed 4-bit codes [N, K // 2]
    (int4=True), written into `out` [N, K] (float32 or bfloat16, contiguous): q * scale + zero
    per group in float32, rounded once to out's dtype. Returns out."""
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous() or out.dim() != 2:
        raise ValueError(f"out must be a contiguous float32 or bfloat16 [N, K] tensor; got {_desc(out)}")
    n, k = out.shape
    want = (n, k // 2) if int4 else (n, k)
    if tuple(q.shape) != want or q.dtype != (torch.uint8 if int4 else torch.int8) or not q.is_contiguous():
        raise ValueError(f"q must be contiguous {'uint8' if int4 else 'int8'} {list(want)}; got {_desc(q)}")
    if k % group_size or tuple(scales.shape) != (n, k // group_size) or scales.dtype != torch.float32 \
            or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float32 [{n}, {k // group_size}]; got {_desc(scales)}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.float32 or not zeros.is_contiguous()):
        raise ValueError(f"zeros must be None or like scales; got {_desc(zeros)}")
    QMATMUL.lib().kvs_group_dequantize(q.data_ptr(), int(int4), scales.data_ptr(),
                                       zeros.data_ptr() if zeros is not None else None, out.data_ptr(),
                                       int(out.dtype == torch.bfloat16), n, k, group_size, torch.get_num_threads(), 0)
    return out


# ---- weights in VNNI blocks (the avx512-vnni path) ----------------------------------------------
_VNNI_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma"})


def vnni_blocks_fit(n: int, k: int, group_size: int) -> bool:
    """Whether a group-quantized weight [N, K] can be kept in VNNI blocks here: N a multiple of 16,
    a group size in 8..256 that is a multiple of 8 and divides K, and a kernel library that runs
    the avx512-vnni path (asked when it is loaded; before that, /proc/cpuinfo's flags answer, so
    loading never waits for a build, and GroupInt8Linear.check_blocks settles it once the library
    is there). Off where the C++ kernels are disabled."""
    from kvshare.config import cpu_flags

    if disabled_by_env() or n <= 0 or n % 16 or not 8 <= group_size <= 256 or group_size % 8 or k % group_size:
        return False
    if QMATMUL.available():
        return bool(QMATMUL.lib().kvs_qmm_vnni_blocks_fit(k, group_size))
    return _VNNI_CPU_FLAGS <= cpu_flags()


@dataclass(frozen=True, eq=False)
class VnniBlocks:
    """A group-quantized weight [N, K] (int8 codes, or 4-bit codes packed two per byte) in the
    layout the avx512-vnni path reads (qmatmul.cpp, "VNNI blocks"): rows in blocks of 16, each
    block as 64-byte lines of 4 bytes from each of its rows: q [N / 16, row_bytes / 4, 16, 4];
    scales and zeros [N / 16, K / g, 16]. Built by `to_vnni_blocks`; `rows` reads rows back."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group: int
    int4: bool

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The codes (int8 [R, K] or packed uint8 [R, K / 2]), scales and zeros [R, K / g] of rows
        idx (a long tensor), in row layout."""
        b, r = idx // 16, idx % 16
        q = self.q[b, :, r, :].reshape(len(idx), -1)
        return q, self.scales[b, :, r], None if self.zeros is None else self.zeros[b, :, r]

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ w.T on the avx512-vnni path (x rounded to int16 per row and group, exact int32
        group sums): x [M, K] float32 or bfloat16, unit last stride; y [M, N] in x's dtype."""
        _check_x(x)
        if x.shape[1] != self.k:
            raise ValueError(f"x {tuple(x.shape)} does not fit a weight of K={self.k}")
        if x.stride(1) != 1 and self.k > 1:
            raise ValueError(f"x must have contiguous rows (unit last stride); got strides {x.stride()}")
        fn = "kvs_int4_group_matmul" if self.int4 else "kvs_int8_group_matmul"
        return _call_group_matmul(fn, x, self.q, self.scales, self.zeros, self.n, self.group, out, "auto",
                                  vnni_blocks=True)

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The dense weights into out [N, K] (float32 or bfloat16, contiguous), the values
        `group_dequantize` gives for the same weight in rows."""
        if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous() \
                or tuple(out.shape) != (self.n, self.k):
            raise ValueError(f"out must be a contiguous float32 or bfloat16 [{self.n}, {self.k}] tensor; "
                             f"got {_desc(out)}")
        QMATMUL.lib().kvs_group_dequantize(
            self.q.data_ptr(), int(self.int4), self.scales.data_ptr(),
            self.zeros.data_ptr() if self.zeros is not None else None, out.data_ptr(),
            int(out.dtype == torch.bfloat16), self.n, self.k, self.group, torch.get_num_threads(), 1)
        return out


def to_vnni_blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   int4: bool) -> VnniBlocks:
    """A weight in rows (q int8 [N, K], or packed 4-bit uint8 [N, K / 2] with int4; scales and
    zeros float32 [N, K / g]) copied into VNNI blocks. N % 16 == 0 and the row's bytes % 4 == 0."""
    n, row_bytes = q.shape
    k = row_bytes * (2 if int4 else 1)
    if n % 16 or row_bytes % 4:
        raise ValueError(f"VNNI blocks need N % 16 == 0 and a multiple of 4 bytes per row; got q {tuple(q.shape)}")
    if not 8 <= group_size <= 256 or group_size % 8 or k % group_size:
        raise ValueError(f"VNNI blocks need a group size in 8..256, a multiple of 8 dividing K={k}; got {group_size}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and tuple(t.shape) != (n, k // group_size):
            raise ValueError(f"{name} must be [{n}, {k // group_size}] (N, K // group_size); got {_desc(t)}")

    def blocked(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N / 16, G, 16]
        return t.reshape(n // 16, 16, -1).transpose(1, 2).contiguous()

    qb = q.reshape(n // 16, 16, row_bytes // 4, 4).permute(0, 2, 1, 3).contiguous()
    return VnniBlocks(qb, blocked(scales.float()), None if zeros is None else blocked(zeros.float()), n, k,
                      group_size, int4)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (an integer tensor [..., K] of values 0..15, K even) two per byte into
    uint8 [..., K // 2], the layout `int4_group_matmul` reads: out[..., j] = q[..., 2j] |
    q[..., 2j + 1] << 4. Raises ValueError on a non-integer tensor, odd K or codes outside 0..15."""
    if not isinstance(q, torch.Tensor) or q.dim() < 1 or q.dtype.is_floating_point or q.dtype.is_complex \
            or q.dtype == torch.bool:
        raise ValueError(f"q must be an integer tensor [..., K]; got {_desc(q)}")
    if q.shape[-1] % 2:
        raise ValueError(f"q must have an even number of columns K; got shape {tuple(q.shape)}")
    if q.numel() and (q.min().item() < 0 or q.max().item() > 15):
        raise ValueError(f"q must hold 4-bit codes 0..15; got values in [{q.min().item()}, {q.max().item()}]")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: uint8 [..., K // 2] -> uint8 codes [..., K] (0..15)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [..., K // 2]; got {_desc(packed)}")
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _check_x(x: object) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K]; got {_desc(x)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16; got {x.dtype}")


def _group_matmul(fn: str, x: torch.Tensor, q_name: str, q: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, group_size: int, out: torch.Tensor | None, impl: str) -> torch.Tensor:
    """The checks both formats share (x and the codes' shape checked by the caller), and the call."""
    m, k = x.shape
    n = q.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing K={k}")
    groups = k // group_size
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales must be float32 [{n}, {groups}] (N, K // group_size); got {_desc(scales)}")
    if zeros is not None and (not isinstance(zeros, torch.Tensor) or zeros.dtype != torch.float32
                              or tuple(zeros.shape) != (n, groups)):
        raise ValueError(f"zeros must be None or float32 [{n}, {groups}] (N, K // group_size); got {_desc(zeros)}")
    named = [("x", x), (q_name, q), ("scales", scales)] + ([("zeros", zeros)] if zeros is not None else [])
    for name, t in named:
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x must have contiguous rows (unit last stride); got strides {x.stride()}")
    for name, t in named[1:]:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if impl not in _QMM_IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {sorted(_QMM_IMPLS)}")
    return _call_group_matmul(fn, x, q, scales, zeros, n, group_size, out, impl, vnni_blocks=False)


def _call_group_matmul(fn: str, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       n: int, group_size: int, out: torch.Tensor | None, impl: str, vnni_blocks: bool) -> torch.Tensor:
    """`out` checked (or made) and the C call, for weights in rows and in VNNI blocks alike (x and
    the weight checked by the caller)."""
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype
          or out.device.type != "cpu" or (out.stride(1) != 1 and n > 1)):
        raise ValueError(f"out must be a CPU tensor [{m}, {n}] of x's dtype {x.dtype} with unit last stride; "
                         f"got {_desc(out)}")
    lib = QMATMUL.lib()
    if m == 0 or n == 0:
        return out
    err = ctypes.create_string_buffer(256)
    rc = getattr(lib, fn)(
        x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16,
        q.data_ptr(), scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
        out.data_ptr(), out.stride(0), m, n, k, group_size,
        _QMM_IMPLS[impl], torch.get_num_threads(), err, len(err), int(vnni_blocks))
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


# ---- prebuild CLI: python -m kvshare.model.cpu_kernels --build -------------------------------
def build_all(timeout: float | None = None) -> list[KernelLibrary]:
    """Blocking: build (in parallel) or load every library; returns them (check `.path()`,
    `.unavailable_reason()`)."""
    for lib in LIBRARIES:
        lib._start()
    for lib in LIBRARIES:
        lib.wait_until_built(timeout)
    return list(LIBRARIES)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvshare.model.cpu_kernels",
                                description="Build or inspect kvshare's optional C++ CPU kernels.")
    p.add_argument("--build", action="store_true", help="build every library now (blocking) into the cache")
    args = p.parse_args(argv)
    print(f"compiler: {find_compiler() or 'none found'}; cache: {cache_dir()}")
    if not args.build:
        p.print_usage()
        return 0
    t0 = time.perf_counter()
    for lib in build_all():
        secs = lib.build_seconds() or 0.0
        if lib.path() is not None:
            how = f"cached build loaded in {secs * 1e3:.0f} ms" if lib.from_cache() else f"compiled in {secs:.1f} s"
            print(f"{lib.name}: {how} -> {lib.path()}")
        else:
            print(f"{lib.name}: NOT BUILT ({secs:.1f} s): {lib._error}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    if disabled_by_env():
        print(f"note: {DISABLE_ENV}={os.environ.get(DISABLE_ENV)} is set, so kvshare will not use them")
    return 0  # a missing compiler is not an error: kvshare falls back to pure PyTorch


if __name__ == "__main__":
    # Run through the package module, so the state lives in the one `kvshare.model.cpu_kernels`.
    from kvshare.model import cpu_kernels as _ck

    sys.exit(_ck._main())
