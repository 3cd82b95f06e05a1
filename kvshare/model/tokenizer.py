"""Tokenizer built on the ``tokenizers`` library, from a GGUF vocabulary or a ``tokenizer.json``.

``transformers`` is deliberately not used here: it is a test-only dependency, and the tests use it
as the reference this module must agree with.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer

from kvshare.model.template_sandbox import TemplateSandbox, render

# Texts (characters) and id lists longer than this go through the backend's batch calls, which
# release the GIL: its single-text encode holds it throughout, and a server thread tokenizing a
# 3.5 MB prompt would stop the event loop for seconds.
GIL_FREE_LENGTH = 4096

# llama.cpp's token_type values (gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's pre-tokenizer regexes, keyed by `tokenizer.ggml.pre`. Each vocabulary's merges were
# learned on text split this way, so a different split gives different (valid-looking) token ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's regex, preceded by splitting every digit on its own (SmolLM/StarCoder-style vocabularies).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_ONLY = {"gpt-2", "gpt2", "default", "mpt", "olmo", "jais", "trillion"}
_LLAMA3_LIKE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_QWEN2_LIKE = {"qwen2", "deepseek-r1-qwen", "megrez"}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        # Same as Hugging Face's SmolLM2 tokenizer.json. ByteLevel's built-in regex is GPT-2's.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_LIKE else _QWEN2_SPLIT if pre in _QWEN2_LIKE else None
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_ONLY and pre is not None:
        warnings.warn(
            f"GGUF tokenizer.ggml.pre={pre!r} is not known to kvshare; splitting text with GPT-2's "
            f"regex, which may tokenize some text differently from the original tokenizer.",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _unk_token(metadata: Mapping[str, Any], tokens: Sequence[str]) -> str | None:
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    return tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None


def _merges_from_vocabulary(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left+right in the vocabulary, best merge first.

    The rank is the merged token's id (lower = earlier in the file = better), then the longer left
    part: the order transformers' ``generate_merges`` gives with the file positions as scores.
    """
    merges: list[tuple[str, str]] = []
    append = merges.append
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):  # generated in rank order: no sort
        for cut in range(len(token) - 1, 0, -1):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    append((left, right))
    return merges


def _template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (used by some HF templates to mark assistant text).

    Rendering only needs the body; which characters were generated is not tracked here.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come with downloaded models, so they are untrusted code: sandboxed, immutable, and
    # each render within a budget (kvshare.model.template_sandbox).
    # trim_blocks/lstrip_blocks are what HF renders with; templates are written against that.
    env = TemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.budget_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def check_chat_template(source: str) -> None:
    """Raise ValueError naming the line if ``source`` is not a chat template this tokenizer can render."""
    try:
        _compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class BatchEncoding(dict):
    """What calling a tokenizer returns, as in transformers: a dict whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """Text <-> token ids, special tokens and chat template for one model.

    The surface vLLM code uses of a Hugging Face tokenizer is here too: calling it, ``encode``,
    ``decode``, ``apply_chat_template``, ``convert_ids_to_tokens``, ``get_vocab``, ``len()``.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        special_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = backend
        self._bos_id = bos_token_id
        self._eos_id = eos_token_id
        self.chat_template = chat_template
        specials = set(special_token_ids)
        specials.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        specials.update(i for i in (bos_token_id, eos_token_id) if i is not None)
        self._special_ids = frozenset(specials)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF ``tokenizer.*`` metadata (values already decoded to Python objects)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_sentencepiece(metadata)
        if kind != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer.ggml.model={kind!r} is not supported; kvshare builds byte-level BPE "
                f"('gpt2') and Gemma's SentencePiece ('llama') tokenizers from GGUF metadata."
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        merges_raw: list[str] | None = metadata.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise NotImplementedError("GGUF gpt2 tokenizer without tokenizer.ggml.merges is not supported.")

        byte_chars = _byte_alphabet()
        alphabet = set(byte_chars.values())

        def spell(token: str) -> str:
            # Regular tokens are stored already spelled in the byte alphabet; a few files store
            # some (e.g. whitespace-only added tokens) as raw text, which BPE could never produce.
            if set(token) <= alphabet:
                return token
            return "".join(byte_chars[b] for b in token.encode("utf-8"))

        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(spell(tok), i)
        merges = []
        for m in merges_raw:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ValueError(f"malformed GGUF merge {m!r}")
            merges.append((left, right))

        backend = _BackendTokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=False)
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>, <|endoftext|>, ...) must match whole in text and be dropped by
        # skip_special_tokens; user-defined ones (e.g. <think>) match whole but are kept when decoding.
        # A control token spelled outside the byte alphabet is a mislabelled vocabulary entry: adding
        # it would mint an id beyond the embedding matrix, so it is left alone.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, token_types)
            if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, token_types)
            if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(
                f"GGUF vocabulary of {len(tokens)} tokens rebuilt into {backend.get_vocab_size(True)} tokens"
            )

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        backend.post_processor = _template_processor(
            (tokens[bos_id], bos_id) if add_bos else None, (tokens[eos_id], eos_id) if add_eos else None
        )
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Gemma's SentencePiece BPE vocabulary (``tokenizer.ggml.model = llama``), rebuilt as Hugging
        Face's GGUF conversion builds it (transformers' ``gemma_tokenizer``, the tests' reference).

        - The file has no merges. They are recovered from the vocabulary: every split of a token into
          two tokens is a merge, ranked by the token's position in the file (Gemma's scores do not
          follow its merge order), longer left parts first.
        - Runs of two or more spaces are stored as real spaces; they are looked up as '▁' runs.
        - Text: spaces become '▁' (no dummy prefix: Gemma 3 sets add_space_prefix false), no
          pre-tokenization, byte fallback to <0xXX> for characters outside the vocabulary.
        - Control tokens (<bos>, <start_of_turn>, <unusedN>, ...) and user-defined ones ('\n', HTML
          tags, ...) match whole in the text, before the space normalization.
        """
        from kvshare.model.families import REGISTRY  # here: the tokenizer alone needs no model code

        arch = metadata.get("general.architecture")
        spm = REGISTRY.spm_tokenizer_architectures()
        if arch not in spm:
            raise NotImplementedError(
                f"GGUF tokenizer.ggml.model='llama' (SentencePiece) is supported for Gemma files "
                f"({', '.join(spm)}), not for architecture {arch!r}: other "
                f"SentencePiece vocabularies need a dummy-prefix rule kvshare does not test."
            )
        if metadata.get("tokenizer.ggml.add_space_prefix", False):
            raise NotImplementedError("a Gemma GGUF vocabulary with add_space_prefix=true is not supported.")
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in metadata["tokenizer.ggml.tokens"]]
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        vocab = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id, as in HF
        backend = _BackendTokenizer(
            models.BPE(vocab=vocab, merges=_merges_from_vocabulary(vocab), unk_token=_unk_token(metadata, tokens),
                       fuse_unk=True, byte_fallback=True, dropout=None)
        )
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        # HF's Gemma tokenizer splits on " ", which never occurs after the normalizer: no split.
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

        raw = list(metadata["tokenizer.ggml.tokens"])
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(raw, token_types) if ty == _TOKEN_TYPE_CONTROL]
        if control:
            backend.add_special_tokens(control)
        known = backend.get_vocab(with_added_tokens=True)
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(raw, token_types) if ty == _TOKEN_TYPE_USER_DEFINED and t in known]
        if user:
            backend.add_tokens(user)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(
                f"GGUF vocabulary of {len(tokens)} tokens rebuilt into {backend.get_vocab_size(True)} tokens"
            )

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        # llama.cpp (and HF) add BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        backend.post_processor = _template_processor(
            (tokens[bos_id], bos_id) if add_bos else None, (tokens[eos_id], eos_id) if add_eos else None
        )
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id,
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_file(
        cls,
        tokenizer_json_path: str | os.PathLike[str],
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Build from a Hugging Face ``tokenizer.json``.

        ``tokenizer_config`` (bos/eos tokens, chat_template) and the chat template
        default to ``tokenizer_config.json`` and ``chat_template.jinja`` next to the file.
        """
        path = os.fspath(tokenizer_json_path)
        directory = os.path.dirname(os.path.abspath(path))
        if tokenizer_config is None:
            cfg_path = os.path.join(directory, "tokenizer_config.json")
            tokenizer_config = {}
            if os.path.isfile(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    tokenizer_config = json.load(f)
        if chat_template is None:
            jinja_path = os.path.join(directory, "chat_template.jinja")
            if os.path.isfile(jinja_path):
                with open(jinja_path, encoding="utf-8") as f:
                    chat_template = f.read()
            else:
                template = tokenizer_config.get("chat_template")
                if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
                    template = named.get("default")
                chat_template = template if isinstance(template, str) else None

        backend = _BackendTokenizer.from_file(path)
        bos = _token_content(tokenizer_config.get("bos_token"))
        eos = _token_content(tokenizer_config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if eos is not None else None
        # BOS/EOS insertion is left to tokenizer.json's post-processor, as transformers 5 does for
        # generic tokenizer.json files (it ignores tokenizer_config's add_bos_token for them).
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, chat_template=chat_template)

    # ---- encoding / decoding ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` adds BOS/EOS when the model's tokenizer asks for them.

        Special tokens written in ``text`` (e.g. ``<|im_start|>``) always become their single id.
        """
        if len(text) > GIL_FREE_LENGTH:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts at once, without holding the GIL."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > GIL_FREE_LENGTH:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None) -> BatchEncoding:
        """``tok(text)`` / ``tok([texts])`` as in transformers: ``input_ids`` and ``attention_mask``."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings")
        ids = self.encode_batch(texts, add_special_tokens=add_special_tokens)
        if truncation and max_length is not None:
            ids = [x[:max_length] for x in ids]
        masks = [[1] * len(x) for x in ids]
        return BatchEncoding(input_ids=ids[0] if single else ids, attention_mask=masks[0] if single else masks)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        """Spelling -> id for the whole vocabulary, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary spellings (byte-level BPE spells a leading space as 'Ġ')."""
        out = []
        for i in ids:
            tok = self._tok.id_to_token(int(i))
            if tok is None:
                raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(tok)
        return out

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary spelling of one id (not its decoded text: a piece may be part of a UTF-8 char)."""
        return self.convert_ids_to_tokens([token_id])[0]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_token(self) -> str | None:
        return self._tok.id_to_token(self._bos_id) if self._bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tok.id_to_token(self._eos_id) if self._eos_id is not None else None

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def backend(self) -> _BackendTokenizer:
        return self._tok

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        render_timeout: float | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (or ``chat_template``, a template
        source that overrides it); ids instead of text if ``tokenize``.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) and ``documents``
        are always defined for the template, None when not given, as in HF; other keyword
        arguments are passed to the template too. ``continue_final_message`` ends the text right
        after the last message's content (no end-of-turn), so generation continues it; as in
        transformers it excludes ``add_generation_prompt``. The defaults differ from transformers'
        (text, with a generation prompt): pass both ``tokenize`` and ``add_generation_prompt``.
        A render that takes longer than ``render_timeout`` seconds (None: no limit) or builds more
        than MAX_TEMPLATE_BUILD characters stops with TemplateLimitError.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second opens a new one")
        source = chat_template or self.chat_template
        if not source:
            raise ValueError(
                "This tokenizer has no chat template (none in the GGUF metadata, tokenizer_config.json or "
                "chat_template.jinja); format the prompt yourself and call encode()."
            )
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "tools": tools, "documents": documents}
        context.update(template_kwargs)
        conversation = [dict(m) for m in messages]
        if continue_final_message:
            conversation = _tag_final_message(conversation)
        text = render(_compile_template(source), render_timeout, messages=conversation,
                      add_generation_prompt=add_generation_prompt, **context)
        if continue_final_message:
            text = _cut_at_tag(text)
        if tokenize:
            # The template already wrote any BOS it wants; adding another would duplicate it.
            return self.encode(text, add_special_tokens=False)
        return text


# transformers' marker: appended to the final message, rendered, and cut at (with what follows).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> list[dict]:
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a final message with text content to continue")
    return messages[:-1] + [dict(messages[-1], content=final + _CONTINUE_TAG)]


def _cut_at_tag(text: str) -> str:
    """transformers' rule: cut at the marker; where the template trimmed the message's trailing
    whitespace, the whitespace before the marker goes too."""
    if _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message: the chat template drops part of the final message, so it "
                         "cannot be continued")
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
