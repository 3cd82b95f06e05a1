"""Grammar engines side by side on this CPU: llguidance vs xgrammar (issue 12).

Both engines have a CPU token-bitmask API (int32 words, bit j of word w = token 32*w + j). For the
bundled model's vocabulary (SmolLM2-135M-Instruct, 49152 tokens) and each of the ten schemas in
kvshare.testing.json_schemas.SCHEMAS this measures, per engine:

  * tokenizer info: the one-off construction of the engine's vocabulary object
    (llguidance.LLTokenizer / xgrammar.TokenizerInfo), per process;
  * compile cold: first compile of the schema with nothing cached (llguidance: JSON schema ->
    grammar -> LLMatcher; xgrammar: a fresh GrammarCompiler, compile_json_schema, GrammarMatcher);
  * first mask: the first bitmask right after the cold compile (llguidance builds its lexer
    lazily, so part of its compile work lands here; xgrammar precomputes its mask cache);
  * compile cached: what a second request with the same schema costs (llguidance: deep_copy() of
    a kept template LLMatcher; xgrammar: GrammarMatcher from the cached CompiledGrammar);
  * mask us/token at batch 1: walk a valid instance of the schema (json.dumps, tokenized with the
    bundled tokenizer); at every position fill the bitmask (timed), check the next token is allowed,
    consume it (timed separately); the last position must allow EOS;
  * mask us/step at batch 32: 32 matchers in the same state fill one [32, words] bitmask in one
    call per position (llguidance: llguidance.torch.fill_next_token_bitmask_par with an LLExecutor;
    xgrammar: BatchGrammarMatcher.batch_fill_next_token_bitmask, its batched C++ fill);
  * applying a [32, 49152] bitmask to float32 logits with plain PyTorch ops (unpack to bool,
    masked_fill_; no torch.compile), a numpy unpackbits(bitorder="little") variant, and, for
    reference, xgrammar's own CPU kernel.

The mask walks are steady state: one untimed warm-up walk per schema and batch size first, then
--walks timed walks of which the fastest is kept (the machine may carry other load).
Each --repeat is a full pass; the table shows the median over repeats per schema, then the median
over schemas. xgrammar is optional: without it only llguidance is measured.

    /work/xg-venv/bin/python benchmarks/grammar_engines.py [--repeat 3] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

import llguidance as llg
import llguidance.torch as llg_torch

from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.loader import bundled_model_path
from kvshare.model.tokenizer import Tokenizer
from kvshare.testing.json_schemas import SCHEMAS

try:
    import xgrammar as xgr
except ImportError:
    xgr = None

BATCH = 32

# One valid instance per schema, properties in the schema's declared order (xgrammar's default
# any_order=False requires it). Serialized with json.dumps' default separators (", ", ": "), which
# both engines' default flexible whitespace accepts.
INSTANCES: dict[str, object] = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "colour_enum": {"colour": "green"},
    "city_nested": {"city": "Lisbon", "location": {"lat": 38.72, "lon": -9.14}},
    "shopping_list": {"items": ["milk", "eggs", "brown bread", "apples"]},
    "rating": {"score": 4.5, "comment": "Friendly staff, good coffee, a bit noisy at lunch."},
    "boolean_flags": {"is_open": True, "has_parking": False},
    "order": {"order_id": 4711, "lines": [{"sku": "ABC-12", "qty": 2}, {"sku": "XYZ-07", "qty": 1}]},
    "weather": {"condition": "rain", "temperature_c": -3},
    "matrix": {"rows": [[1, 2], [3, 4]]},
    "book": {"title": "Moby-Dick", "author": {"first": "Herman", "last": "Melville"},
             "year": 1851, "genre": "novel"},
}


def now() -> int:
    return time.perf_counter_ns()


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


# --------------------------------------------------------------------------- llguidance


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, threads: int):
        self.tok = tok
        self.vocab = tok.vocab_size
        t0 = now()
        self.lltok = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                     eos_token=tok.eos_token_id)
        self.tokinfo_ns = now() - t0
        self.executor = llg.LLExecutor(num_threads=threads)

    def compile_cold(self, schema: dict):
        grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        m = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance: {m.get_error()}")
        return m  # the kept template

    def matcher_cached(self, template):
        return template.deep_copy()

    def fill1(self, m, bitmask):
        llg_torch.fill_next_token_bitmask(m, bitmask, 0)

    def consume1(self, m, token: int) -> bool:
        return m.consume_token(token)

    def fill_batch(self, ms, bitmask):
        llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                              bitmask)

    def consume_batch(self, ms, token: int) -> bool:
        return all(llg_torch.consume_token_par(self.executor, [(m, token) for m in ms]))


# --------------------------------------------------------------------------- xgrammar


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, threads: int):
        self.tok = tok
        self.vocab = tok.vocab_size
        self.threads = threads
        t0 = now()
        enc = tok.backend.get_vocab(with_added_tokens=True)  # byte-level strings ("Ġ" = space)
        encoded_vocab = [""] * tok.vocab_size
        for s, i in enc.items():
            encoded_vocab[i] = s
        self.info = xgr.TokenizerInfo(encoded_vocab, xgr.VocabType.BYTE_LEVEL,
                                      vocab_size=tok.vocab_size,
                                      stop_token_ids=[tok.eos_token_id], add_prefix_space=False)
        self.tokinfo_ns = now() - t0
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile_cold(self, schema: dict):
        compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads)  # fresh: empty cache
        cg = compiler.compile_json_schema(schema)
        xgr.GrammarMatcher(cg)
        return cg  # the cached CompiledGrammar

    def matcher_cached(self, cg):
        return xgr.GrammarMatcher(cg)

    def fill1(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask, 0)

    def consume1(self, m, token: int) -> bool:
        return m.accept_token(token)

    def fill_batch(self, ms, bitmask):
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def consume_batch(self, ms, token: int) -> bool:
        return all(xgr.BatchGrammarMatcher.batch_accept_token(ms, [token] * len(ms)))


# --------------------------------------------------------------------------- walks


def walk1(eng, m, tokens: list[int], eos: int, words: int,
          keep: list | None = None) -> tuple[list[int], list[int]]:
    """Fill + consume at every position of `tokens`, then one last fill that must allow EOS.
    Returns (fill ns per mask, consume ns per token); appends each mask to `keep` if given."""
    bm = torch.zeros((1, words), dtype=torch.int32)
    fills, consumes = [], []
    for pos, t in enumerate(tokens + [eos]):
        t0 = now()
        eng.fill1(m, bm)
        fills.append(now() - t0)
        if keep is not None:
            keep.append(bm[0].clone())
        if not allowed(bm, 0, t):
            raise RuntimeError(f"{eng.name}: token {t} at position {pos} not in the mask")
        if t == eos:
            break
        t0 = now()
        ok = eng.consume1(m, t)
        consumes.append(now() - t0)
        if not ok:
            raise RuntimeError(f"{eng.name}: token {t} at position {pos} rejected")
    return fills, consumes


def walk_batch(eng, ms, tokens: list[int], eos: int, words: int):
    bm = torch.zeros((len(ms), words), dtype=torch.int32)
    fills, consumes = [], []
    for pos, t in enumerate(tokens + [eos]):
        t0 = now()
        eng.fill_batch(ms, bm)
        fills.append(now() - t0)
        if not (allowed(bm, 0, t) and allowed(bm, len(ms) - 1, t)):
            raise RuntimeError(f"{eng.name}: batch token {t} at position {pos} not in the mask")
        if t == eos:
            break
        t0 = now()
        ok = eng.consume_batch(ms, t)
        consumes.append(now() - t0)
        if not ok:
            raise RuntimeError(f"{eng.name}: batch token {t} at position {pos} rejected")
    return fills, consumes


def measure_engine(eng, tokenized: dict[str, list[int]], eos: int, words: int,
                   walks: int, keep: list | None = None) -> dict:
    """One pass over all schemas. Returns {schema: {metric: value}} (times in ms or us).
    Each timed walk runs `walks` times and the fastest is kept (filters other load)."""
    out: dict[str, dict[str, float]] = {}
    for name, schema in SCHEMAS:
        toks = tokenized[name]
        r: dict[str, float] = {}
        t0 = now()
        tmpl = eng.compile_cold(schema)
        r["cold_ms"] = (now() - t0) / 1e6
        first = eng.matcher_cached(tmpl)
        bm = torch.zeros((1, words), dtype=torch.int32)
        t0 = now()
        eng.fill1(first, bm)
        r["first_mask_ms"] = (now() - t0) / 1e6
        cached = []
        for _ in range(20):
            t0 = now()
            eng.matcher_cached(tmpl)
            cached.append(now() - t0)
        r["cached_ms"] = statistics.median(cached) / 1e6

        walk1(eng, eng.matcher_cached(tmpl), toks, eos, words, keep)  # warm-up
        best = min((walk1(eng, eng.matcher_cached(tmpl), toks, eos, words) for _ in range(walks)),
                   key=lambda fc: sum(fc[0]))
        r["mask1_us"] = statistics.mean(best[0]) / 1e3
        r["consume1_us"] = statistics.mean(best[1]) / 1e3

        walk_batch(eng, [eng.matcher_cached(tmpl) for _ in range(BATCH)], toks, eos, words)
        best = min((walk_batch(eng, [eng.matcher_cached(tmpl) for _ in range(BATCH)], toks, eos,
                               words) for _ in range(walks)), key=lambda fc: sum(fc[0]))
        r["mask32_us"] = statistics.mean(best[0]) / 1e3
        r["consume32_us"] = statistics.mean(best[1]) / 1e3
        out[name] = r
    return out


# --------------------------------------------------------------------------- applying the mask


def mask_apply(vocab: int, real_masks: list[torch.Tensor], threads_list: list[int],
               reps: int = 100) -> dict[str, float]:
    """Median us per call to mask [B, vocab] float32 logits with a [B, words] int32 bitmask, B = 1
    and BATCH. The bitmask rows are real masks from the walks (a spread of grammar states), not
    random bits: masked_fill_'s cost depends on how the allowed tokens are laid out."""
    idx = [round(i * (len(real_masks) - 1) / (BATCH - 1)) for i in range(BATCH)]
    bm = torch.stack([real_masks[i] for i in idx]).contiguous()
    base = torch.randn((BATCH, vocab), generator=torch.Generator().manual_seed(0))
    bits = torch.tensor([1 << i for i in range(31)] + [-2**31], dtype=torch.int32)
    ninf = float("-inf")

    def torch_unpack(logits, bm):
        disallowed = (bm.unsqueeze(-1) & bits).eq(0).view(bm.shape[0], -1)[:, :vocab]
        logits.masked_fill_(disallowed, ninf)

    ninf_t = torch.tensor(ninf)

    def torch_unpack_where(logits, bm):
        disallowed = (bm.unsqueeze(-1) & bits).eq(0).view(bm.shape[0], -1)[:, :vocab]
        torch.where(disallowed, ninf_t, logits, out=logits)

    def numpy_unpack(logits, bm):
        u8 = np.unpackbits(bm.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
        logits.masked_fill_(~torch.from_numpy(u8).view(torch.bool), ninf)

    variants = {"torch: (bm & bits).eq(0) + masked_fill_": torch_unpack,
                "torch: (bm & bits).eq(0) + where(out=logits)": torch_unpack_where,
                "numpy: unpackbits(little) + masked_fill_": numpy_unpack}
    if xgr is not None:
        variants["xgrammar's CPU kernel (reference)"] = (
            lambda logits, bm: xgr.apply_token_bitmask_inplace(logits, bm, backend="cpu"))

    # correctness: every variant agrees with a bit-by-bit reference on two rows
    ref_allowed = torch.tensor(
        [[(int(bm[b, j >> 5]) >> (j & 31)) & 1 for j in range(vocab)] for b in (0, BATCH - 1)],
        dtype=torch.bool)
    for label, fn in variants.items():
        lg = base.clone()
        fn(lg, bm)
        if not torch.equal(torch.isfinite(lg[[0, BATCH - 1]]), ref_allowed):
            raise RuntimeError(f"mask apply variant {label!r} disagrees with the reference")

    out = {}
    old = torch.get_num_threads()
    try:
        for nt in threads_list:
            torch.set_num_threads(nt)
            for label, fn in variants.items():
                for batch in (1, BATCH):
                    lg, m = base[:batch].clone(), bm[:batch].contiguous()
                    for _ in range(5):
                        fn(lg, m)
                    ts = []
                    for _ in range(reps):
                        t0 = now()
                        fn(lg, m)
                        ts.append(now() - t0)
                    out[f"{label}, B={batch}, torch threads {nt}"] = statistics.median(ts) / 1e3
    finally:
        torch.set_num_threads(old)
    return out


# --------------------------------------------------------------------------- report


def med(xs):
    return statistics.median(xs)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="full passes; the median is reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for LLExecutor, BatchGrammarMatcher and GrammarCompiler "
                         "(default: all cores)")
    ap.add_argument("--walks", type=int, default=3,
                    help="timed walks per schema and pass; the fastest is kept (default 3)")
    args = ap.parse_args()

    t0 = now()
    tok = Tokenizer.from_gguf_metadata(open_gguf_file(bundled_model_path()).metadata)
    tok_ms = (now() - t0) / 1e6
    vocab, eos = tok.vocab_size, tok.eos_token_id
    words = (vocab + 31) // 32
    tokenized = {name: tok.encode(json.dumps(INSTANCES[name]), add_special_tokens=False)
                 for name, _ in SCHEMAS}

    xgr_version = None
    if xgr is not None:
        from importlib.metadata import version
        xgr_version = version("xgrammar")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); engine threads {args.threads}")
    print(f"vocab {vocab} tokens ({words} bitmask words), eos {eos}; kvshare tokenizer "
          f"{tok_ms:.0f} ms; repeat {args.repeat}")
    from importlib.metadata import version as _v
    print(f"llguidance {_v('llguidance')}; "
          + (f"xgrammar {xgr_version}" if xgr else
             "xgrammar not installed: pip install xgrammar to compare"))
    print("batch-32 fill: llguidance fill_next_token_bitmask_par (LLExecutor), xgrammar "
          "BatchGrammarMatcher.batch_fill_next_token_bitmask (one batched call each, no loop)")

    engine_classes = [LLGuidance] + ([XGrammar] if xgr is not None else [])
    # runs[engine][schema][metric] -> list over repeats; tokinfo[engine] -> list
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    tokinfo: dict[str, list[float]] = {}
    apply_runs: dict[str, list[float]] = {}
    torch_threads = sorted({1, torch.get_num_threads()})
    for rep in range(args.repeat):
        real_masks: list[torch.Tensor] = []
        for cls in engine_classes:
            eng = cls(tok, args.threads)
            tokinfo.setdefault(cls.name, []).append(eng.tokinfo_ns / 1e6)
            res = measure_engine(eng, tokenized, eos, words, args.walks,
                                 real_masks if cls is LLGuidance else None)
            for schema, metrics in res.items():
                for k, v in metrics.items():
                    runs.setdefault(cls.name, {}).setdefault(schema, {}).setdefault(k, []).append(v)
            del eng
        for k, v in mask_apply(vocab, real_masks, torch_threads).items():
            apply_runs.setdefault(k, []).append(v)
        print(f"  pass {rep + 1}/{args.repeat} done")

    names = [n for n, _ in SCHEMAS]
    engines = [c.name for c in engine_classes]
    m = {e: {s: {k: med(v) for k, v in runs[e][s].items()} for s in names} for e in engines}

    print()
    print("tokenizer info (one-off, ms): " + ", ".join(
        f"{e} {med(tokinfo[e]):.1f}" for e in engines))
    metrics = [("cold_ms", "cold ms", 1), ("cached_ms", "cached ms", 3),
               ("mask1_us", "b1 us/tok", 1), ("mask32_us", "b32 us/step", 1)]
    short = {"llguidance": "llg", "xgrammar": "xgr"}
    cols = [(e, k, f"{short[e]} {label}", d) for k, label, d in metrics for e in engines]
    head = f"{'schema':<14}{'tok':>4}" + "".join(f"{c[2]:>17}" for c in cols)
    print(head)
    print("-" * len(head))
    for s in names:
        row = f"{s:<14}{len(tokenized[s]):>4}"
        for e, k, _, d in cols:
            row += f"{m[e][s][k]:>17.{d}f}"
        print(row)
    print("-" * len(head))
    medians = {e: {k: med([m[e][s][k] for s in names]) for k in m[e][names[0]]} for e in engines}
    row = f"{'median':<14}{med([len(tokenized[s]) for s in names]):>4.0f}"
    for e, k, _, d in cols:
        row += f"{medians[e][k]:>17.{d}f}"
    print(row)
    if len(engines) == 2:
        row = f"{'xgr/llg':<14}{'':>4}"
        for e, k, _, d in cols:
            row += f"{'':>17}" if e == "llguidance" else \
                f"{medians['xgrammar'][k] / medians['llguidance'][k]:>16.2f}x"
        print(row)
        ratios = {k: med([m["xgrammar"][s][k] / m["llguidance"][s][k] for s in names])
                  for k, *_ in metrics}
        print("median over schemas of the per-schema ratio xgr/llg: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in ratios.items()))

    print()
    print("detail (medians over schemas): first mask after the cold compile ms, "
          "consume us/token batch 1, consume us/step batch 32 "
          "(llguidance consume_token_par, xgrammar batch_accept_token)")
    for e in engines:
        print(f"  {e:<11} first mask {medians[e]['first_mask_ms']:.3f} ms; cold+first mask "
              f"{med([m[e][s]['cold_ms'] + m[e][s]['first_mask_ms'] for s in names]):.2f} ms; "
              f"consume b1 {medians[e]['consume1_us']:.1f} us; "
              f"consume b32 {medians[e]['consume32_us']:.1f} us; "
              f"per row at b32 {medians[e]['mask32_us'] / BATCH:.1f} us mask")
    print()
    print(f"applying a real [B, {words}] bitmask to float32 logits [B, {vocab}] "
          "(median us per call, median of passes):")
    for k, v in apply_runs.items():
        print(f"  {k:<72} {med(v):>9.1f}")


if __name__ == "__main__":
    main()
