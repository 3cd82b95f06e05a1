"""Random-weight GGUF files of real model shapes, for speed benchmarks only.

Speed depends on a model's shape and its quantization format, not on what its weights learned,
so the benchmarks time kvshare and llama.cpp on files with the dimensions of real models
(Llama-3.2-1B, Llama-3.1-8B, ...) filled with random numbers: the bundled SmolLM2 tokenizer
(vocabulary 49152, so every file tokenizes the same text the same way), float16 weights written
with the `gguf` package, then quantized by llama.cpp's own `llama-quantize` (built by
benchmarks/build_llama_cpp.sh), exactly as a user's downloaded file was made. Files go to the
git-ignored bench_out/real_shapes/; they are never committed and never used by tests.

    python benchmarks/real_shape_gguf.py llama-3.2-1b Q4_K_M     # prints the file's path
    python benchmarks/real_shape_gguf.py --list

An existing file is reused (delete it to rebuild). The float16 intermediate is deleted after
quantizing unless --keep-f16.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "bench_out", "real_shapes")
QUANTIZE = os.path.join(ROOT, "bench_out", "llama_cpp", "bin", "llama-quantize")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    tied: bool  # output.weight shared with token_embd.weight
    rope_base: float = 500000.0
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3
    sliding_window: int = 0  # Gemma 3's local layers
    fused_qkv: bool = False  # Phi-3: attn_qkv, ffn_up holds gate and up


# Dimensions as in each model's config.json (vocabulary replaced by the bundled tokenizer's).
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 64, tied=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128, tied=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128, tied=False),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 128, tied=False, rope_base=1e6, qkv_bias=True),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 9728, 128, tied=True, rope_base=1e6, qk_norm=True),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 6912, 256, tied=True, rope_base=1e6, qk_norm=True,
                        sliding_window=512),
    "phi-3-mini": Shape("phi3", 3072, 32, 32, 32, 8192, 96, tied=False, rope_base=10000.0, fused_qkv=True),
}


def _tokenizer_metadata() -> dict:
    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.loader import bundled_model_path

    meta = open_gguf_file(bundled_model_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def _tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, row-major shape) in llama.cpp's order and naming."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (s.hidden,)))
        if s.fused_qkv:
            out.append((b + "attn_qkv.weight", (q + 2 * kv, s.hidden)))
        else:
            out += [(b + "attn_q.weight", (q, s.hidden)), (b + "attn_k.weight", (kv, s.hidden)),
                    (b + "attn_v.weight", (kv, s.hidden))]
        if s.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if s.qk_norm:
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        out.append((b + "attn_output.weight", (s.hidden, q)))
        if s.arch == "gemma3":
            out += [(b + "post_attention_norm.weight", (s.hidden,)), (b + "post_ffw_norm.weight", (s.hidden,))]
        out.append((b + "ffn_norm.weight", (s.hidden,)))
        if s.fused_qkv:
            out.append((b + "ffn_up.weight", (2 * s.ffn, s.hidden)))
        else:
            out += [(b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden))]
        out.append((b + "ffn_down.weight", (s.hidden, s.ffn)))
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def _metadata(w, s: Shape, name: str, vocab: int) -> None:
    a = s.arch
    # llama.cpp gives models named "phi-3" special-token attributes (<|end|>, ...) that the
    # bundled tokenizer lacks, and then refuses the file: no family name in general.name.
    w.add_name(f"random-weight {name.replace('-', '_')}")
    w.add_file_type(1)  # mostly float16
    w.add_block_count(s.layers)
    w.add_context_length(8192)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(1e-6 if a in ("qwen2", "qwen3", "gemma3") else 1e-5)
    w.add_vocab_size(vocab)
    if a in ("qwen3", "gemma3"):
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    else:
        w.add_rope_dimension_count(s.head_dim)
    if a == "gemma3":
        w.add_sliding_window(s.sliding_window)
    if a == "phi3":
        w.add_sliding_window(0)


def write_f16(name: str, path: str, seed: int = 0) -> None:
    """The float16 file: weights N(0, 0.02), norms near 1, written tensor by tensor (an 8B model's
    16 GB never sits in memory at once)."""
    import gguf

    s = SHAPES[name]
    tok = _tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, s.arch)
    _metadata(w, s, name, vocab)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types([int(t) for t in tok["tokenizer.ggml.token_type"]])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(False)
    w.add_chat_template(tok["tokenizer.chat_template"])
    tensors = _tensors(s, vocab)
    for tname, shape in tensors:
        dt = np.float16 if len(shape) == 2 else np.float32
        w.add_tensor_info(tname, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shape in tensors:
        if len(shape) == 2:
            arr = np.empty(shape, dtype=np.float16)
            for r0 in range(0, shape[0], 1024):  # bounded float32 scratch
                rows = arr[r0:r0 + 1024]
                rows[...] = rng.standard_normal(rows.shape, dtype=np.float32) * np.float32(0.02)
        elif "bias" in tname:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        else:
            arr = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        w.write_tensor_data(arr)
    w.close()


def real_shape_gguf(name: str, fmt: str, keep_f16: bool = False, threads: int = 2) -> str:
    """The path of `name` quantized to `fmt` (e.g. Q4_K_M), built if absent."""
    os.makedirs(OUT_DIR, exist_ok=True)
    out = os.path.join(OUT_DIR, f"{name}-{fmt}.gguf")
    if os.path.exists(out):
        return out
    f16 = os.path.join(OUT_DIR, f"{name}-F16.gguf")
    if not os.path.exists(f16):
        t0 = time.perf_counter()
        write_f16(name, f16 + ".part")
        os.replace(f16 + ".part", f16)
        print(f"[real_shape_gguf] wrote {f16} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if fmt.upper() == "F16":
        return f16
    if not os.path.exists(QUANTIZE):
        raise SystemExit(f"{QUANTIZE} is missing: run benchmarks/build_llama_cpp.sh")
    t0 = time.perf_counter()
    done = subprocess.run([QUANTIZE, f16, out + ".part", fmt, str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-quantize {fmt} failed:\n{done.stderr[-3000:]}")
    os.replace(out + ".part", out)
    print(f"[real_shape_gguf] quantized {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if not keep_f16:
        os.remove(f16)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("formats", nargs="*", default=["Q4_K_M"], help="llama-quantize types (default Q4_K_M)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the float16 intermediate (for more formats)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list or not args.shape:
        for n, s in SHAPES.items():
            print(n, s)
        return 0
    for i, fmt in enumerate(args.formats):
        print(real_shape_gguf(args.shape, fmt, keep_f16=args.keep_f16 or i + 1 < len(args.formats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
