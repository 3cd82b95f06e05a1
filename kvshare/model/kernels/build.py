"""Building kvshare's C++ CPU kernels: plain C ABI shared libraries, compiled with a direct
compiler call into a per-user cache and loaded through ctypes (`KernelLibrary`). Sources live in
`kvshare/model/csrc/`; each binding module of this package declares one library's C signatures.

Building never makes a request wait:

* `KernelLibrary.available()` never blocks on a compiler. It is True when the library is loaded,
  or when a cached build exists and loads (milliseconds: one `c++ --version` and a dlopen).
  Otherwise it starts one background thread that compiles the library and answers False until
  that finishes. The engine does not poll it: it settles every library it needs before its
  first step (`KernelLibrary.settle`, kvshare.model.numerics).
* `wait_until_built(timeout=None)` blocks until the build is done (tests, benchmarks, setup);
  `python -m kvshare.model.kernels --build` prebuilds every library (`make setup`).
* The compiler is `$CXX` if set, else `c++` or `g++` from PATH, run as
  `c++ -O3 -fopenmp -fno-math-errno -shared -fPIC src -o lib` (no -march: the code picks its
  paths with target attributes and runtime CPU checks). The output lands in
  `$KVSHARE_CACHE_DIR` (default ~/.cache/kvshare/kernels), never in the source tree, named by a
  hash of the source text, the flags and the compiler's version string. It is compiled in a
  private temp dir and renamed into place atomically: concurrent processes need no lock (at
  worst both compile and the second rename wins, with identical content).
* Nothing here raises at import. A failure (no compiler, compile error, non-POSIX, unwritable
  cache) makes `available()` False, with the reason logged once at INFO and returned by
  `unavailable_reason()`; it is not retried in this process. A failed compile's full log is
  kept in the temp dir (`build_log_path`), named in the reason.

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
import tempfile
import threading
import time
from typing import Callable

import torch

logger = logging.getLogger("kvshare")

DISABLE_ENV = "KVSHARE_DISABLE_CPP_KERNELS"
CACHE_ENV = "KVSHARE_CACHE_DIR"
CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
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

    def settle(self) -> str | None:
        """Blocking, for build time: load the library (compiling it first if no cached build
        exists) unless KVSHARE_DISABLE_CPP_KERNELS is set, and say why it cannot be used (None:
        it can). What an engine decides from this answer it keeps for its whole life: it never
        asks `available()` during a step."""
        if disabled_by_env():
            return f"disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
        if self.wait_until_built():
            return None
        return self._error or "build failed"

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


def _keep_log(path: str, log: str) -> str:
    """A failed compile's whole log, kept in the temp dir (not the cache: it holds built libraries
    only) under the name of the library it was for, so a rerun replaces it; its path, or why not."""
    log_path = os.path.join(tempfile.gettempdir(), os.path.basename(path).removesuffix(".so") + ".build.log")
    try:
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(log + "\n")
    except OSError as e:
        return f"not written: {e}"
    return log_path


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
            raise RuntimeError(f"compiling {source_name} failed (exit {res.returncode}): {' '.join(argv)} "
                               f"(full log: {_keep_log(path, log)})\n{log[-4000:]}")
        os.chmod(so, 0o755)
        os.replace(so, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(t: object) -> str:
    """An argument as the bindings' errors name it: a tensor's dtype, shape and device, else its type."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__
