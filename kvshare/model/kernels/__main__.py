"""`python -m kvshare.model.kernels --build`: build every C++ kernel library into the cache now
(`make setup` runs it, so no engine start compiles them)."""
from __future__ import annotations

import os
import sys
import time

from kvshare.model.kernels import build_all
from kvshare.model.kernels.build import DISABLE_ENV, cache_dir, disabled_by_env, find_compiler


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvshare.model.kernels",
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
    return 0  # not an error here: the exact mode runs without them; the default mode says what it misses


if __name__ == "__main__":
    sys.exit(_main())
