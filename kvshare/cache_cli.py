"""`kvshare cache ls|stats|clear|verify`: the disk KV tier's directory, for operators, without
an engine (docs/kv_tiers.md). Each file is one block (kvshare/engine/kv_tier_store.py): its
header says which model, tokenizer, KV layout and hash seed wrote it; `verify` reads every
payload against its checksum."""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

from kvshare.engine.kv_tier_store import SUFFIX, block_file_name, read_block_file, read_header


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise ValueError(f"--kv-disk-path {path!r} is not a directory")
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(SUFFIX))


def _kind(header: dict) -> str:
    """Who wrote a block, short: model, KV dtype, block size, hash seed (identities abbreviated)."""
    return (f"model {str(header.get('model'))[:12]} tokenizer {str(header.get('tokenizer'))[:12]} "
            f"{header.get('kv_dtype')} block_size {header.get('block_size')} seed {str(header.get('hash_seed'))[:12]}")


def cmd_cache(args: argparse.Namespace) -> int:
    files = _files(args.kv_disk_path)
    if args.cache_command == "ls":
        rows = []
        for path in files:
            try:
                header, _ = read_header(path)
            except (OSError, ValueError) as e:
                rows.append({"file": os.path.basename(path), "error": str(e)})
                continue
            rows.append({"hash": header.get("hash"), "group": header.get("group"), "tokens": len(header.get("tokens") or ()),
                         "bytes": os.path.getsize(path), "written": time.strftime(
                             "%Y-%m-%dT%H:%M:%SZ", time.gmtime(os.path.getmtime(path))), "writer": _kind(header)})
        for row in rows:
            print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
        return 0
    if args.cache_command == "stats":
        kinds: Counter[str] = Counter()
        unreadable = 0
        for path in files:
            try:
                kinds[_kind(read_header(path)[0])] += 1
            except (OSError, ValueError):
                unreadable += 1
        stats = {"directory": args.kv_disk_path, "blocks": len(files),
                 "bytes": sum(os.path.getsize(p) for p in files), "unreadable": unreadable, "by_writer": dict(kinds)}
        print(json.dumps(stats, indent=2))
        return 0
    if args.cache_command == "clear":
        stale = [os.path.join(args.kv_disk_path, n) for n in os.listdir(args.kv_disk_path) if n.endswith(".tmp")]
        for path in files + stale:
            os.remove(path)
        print(f"removed {len(files)} block files and {len(stale)} unfinished writes from {args.kv_disk_path}")
        return 0
    bad = 0  # verify
    for path in files:
        try:
            header, _ = read_block_file(path)
            if block_file_name(header.get("hash"), header.get("group")) != os.path.basename(path):
                raise ValueError("foreign header: the file's name is not its block's hash and KV cache group")
        except (OSError, ValueError, TypeError) as e:
            bad += 1
            print(f"BAD {os.path.basename(path)}: {e}")
    print(f"{len(files) - bad} of {len(files)} block files intact" + (f", {bad} bad (an engine treats them as "
                                                                         f"misses)" if bad else ""))
    return 1 if bad else 0


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="the disk KV tier's directory: ls, stats, clear, verify")
    c.add_argument("cache_command", choices=("ls", "stats", "clear", "verify"))
    c.add_argument("--kv-disk-path", required=True, metavar="DIR", help="the disk tier's directory")
    c.add_argument("--json", action="store_true", help="ls: one JSON object per block")
    c.set_defaults(func=cmd_cache)
