"""Incremental detokenization with stop-string handling (vLLM semantics).

Usage per request::

    d = IncrementalDetokenizer.from_params(tokenizer, prompt_token_ids, params)
    for each sampled token t:               # (the engine decides about eos / stop_token_ids itself)
        delta = d.add(t)                    # text safe to stream now ("" if nothing is final yet)
        if d.check_stop() is not None:      # a stop string matched: finish_reason="stop",
            ...                             #   stop_reason=d.check_stop(); d.text is cut there
    at the end for any other reason (eos, stop token, length, abort):
        delta = d.flush()                   # everything still held back

``d.text`` is always the concatenation of what add()/flush() returned so far, so it can be
used for cumulative (non-delta) outputs too. Nothing returned ever lies beyond the stop-string
cut -- provided the stop strings were given at construction (``stop=`` or ``from_params``).

Compatibility mode: ``check_stop(stop_list, include_stop_str_in_output)`` may also be called
with explicit arguments after each add(). If they differ from the configured ones (e.g. none
were given at construction) they are adopted then and the text added by the most recent add()
is searched. The final text is then still exact, but text that add() returned before that
first call was not held back (a stop string starting inside it can shrink ``text``).

Two kinds of text are held back from ``add()``:

* UTF-8: byte-level BPE (and SentencePiece byte fallback) can split one character over several
  tokens. While the decoded window ends in U+FFFD, the trailing run of U+FFFD is held (the text
  before it is final and is emitted) until a token completes the character or ends the run. A
  run is held for at most ``_MAX_HELD_TOKENS`` tokens (degenerate streams of invalid bytes);
  after that it is emitted as is, and only then may the output differ from a one-shot decode
  (in how many U+FFFD it shows).
* Stop strings (when configured and ``include_stop_str_in_output`` is False): the longest suffix
  of the text that is a proper prefix of some stop string is held, since the next tokens may
  complete the stop string and the text from its start on would then be cut. With
  ``include_stop_str_in_output`` nothing needs holding: the cut is always after new text.

Stop-string rules (vLLM): strings are only checked once more than ``min_tokens`` output tokens
have been added (the constructor's ``min_tokens``; in compatibility mode the caller gates by
when it calls check_stop), and only matches that end inside the newly added text count. If
several stop strings complete in the same step, the one that completes first (smallest end
offset; then the longest, then list order) wins, which makes the result independent of how the text is split
into tokens. The text is cut right before the stop string, or right after it with
``include_stop_str_in_output``.

Decoding keeps the last few prompt tokens as left context and only ever decodes a small window of
recent tokens (``prefix_offset``/``read_offset``), so each step costs O(window), not O(output).
"""
from __future__ import annotations

from array import array
from typing import Protocol, Sequence

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context (leading-space behaviour)
_MAX_HELD_TOKENS = 32  # stop waiting for a character to complete after this many tokens
_TRIM_IDS_AT = 256  # drop ids before the decode window once this many have accumulated
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        stop: Sequence[str] | str | StopStrings | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        ctx = [int(t) for t in list(prompt_token_ids)[-_CONTEXT_TOKENS:]]
        ctx_text = self._decode(ctx) if ctx else ""
        if ctx_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character: its bytes would merge with the output's; decode the
            # output on its own instead.
            ctx, ctx_text = [], ""
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = ctx_text
        self._window_emitted = 0  # chars of the current window already emitted past prefix_text
        self._num_output = 0

        # text bookkeeping (global char offsets into the output text)
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._len = 0
        self._emitted = 0  # chars already returned by add()/flush()
        self._finished = False
        self._stop_str: str | None = None

        self._last_add_start = 0  # text length before the most recent add()'s new text
        self._min_tokens = int(min_tokens)
        self._stop: list[str] = []
        self._stop_strings = StopStrings(())
        self._stop_state = 0  # the automaton's state after the text so far
        self._include = False
        self._max_stop = 0
        # suffix of the text starting at global offset _recent_start; it always covers the
        # unemitted text and the last (max_stop - 1) chars.
        self._recent = ""
        self._recent_start = 0
        self._configure(stop if isinstance(stop, StopStrings) else StopStrings(_as_list(stop)),
                        bool(include_stop_str_in_output))

    @classmethod
    def from_params(cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params) -> "IncrementalDetokenizer":
        """Build from a SamplingParams (stop_strings, include_stop_str_in_output, min_tokens,
        skip_special_tokens)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    # ------------------------------------------------------------------ public API
    @property
    def text(self) -> str:
        """The output text so far: while running, exactly what add() has returned (held-back
        text is not included until it is final); once finished (stop string or flush()), the
        final text, cut at the stop string if one matched."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache] if self._text_cache else []
        return self._text_cache if self._finished else self._text_cache[: self._emitted]

    @property
    def decoded_text(self) -> str:
        """All text decoded so far, including text held back for a possible stop string."""
        self.text  # noqa: B018 (refreshes the cache)
        return self._text_cache or ""

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    @property
    def finished(self) -> bool:
        """True after a stop string matched or flush() was called; add() then raises."""
        return self._finished

    def check_stop(
        self, stop: Sequence[str] | str | None = None, include_stop_str_in_output: bool | None = None
    ) -> str | None:
        """The stop string that ended the output, or None.

        Without arguments this only reports (add() does the checking). With arguments that
        differ from the current configuration (compatibility mode, see the module docstring)
        they are adopted and the text of the most recent add() is searched now."""
        if stop is not None and not self._finished:
            stops = _as_list(stop)
            include = self._include if include_stop_str_in_output is None else bool(include_stop_str_in_output)
            if stops != self._stop or include != self._include:
                self._configure(StopStrings(stops) if stops != self._stop else self._stop_strings, include)
                if self._stop:
                    self._search(self._last_add_start)
                self._trim_recent()
        return self._stop_str

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly finalized, stream-safe text."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after the output finished")
        self._ids.append(int(token_id))
        self._num_output += 1
        new_text = self._decode(self._ids[self._prefix_offset :])
        base = len(self._prefix_text) + self._window_emitted
        delta = ""
        if not new_text.endswith(_REPLACEMENT) or len(self._ids) - self._read_offset >= _MAX_HELD_TOKENS:
            if len(new_text) > len(self._prefix_text):
                delta = new_text[base:]
                self._advance()
        else:
            # Ends in U+FFFD: a character may still be incomplete. Everything before the trailing
            # run of U+FFFD is final (a complete character never changes), so emit that part.
            stable = len(new_text.rstrip(_REPLACEMENT))
            if stable > base:
                delta = new_text[base:stable]
                self._window_emitted += len(delta)
        return self._take(delta, final=False)

    def flush(self) -> str:
        """Finish the output: return everything still held back (an incomplete character is
        emitted as U+FFFD; a stop string completed by it is still honoured)."""
        if self._finished:  # (after a stop string: only text not yet returned, normally none)
            out = self.decoded_text[self._emitted :]
            self._emitted = self._len
            return out
        delta = ""
        if self._read_offset < len(self._ids):
            new_text = self._decode(self._ids[self._prefix_offset :])
            delta = new_text[len(self._prefix_text) + self._window_emitted :]
            self._advance()
        out = self._take(delta, final=True)
        self._finished = True
        return out

    # ------------------------------------------------------------------ internals
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self) -> None:
        self._window_emitted = 0
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_IDS_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _append(self, delta: str) -> None:
        self._chunks.append(delta)
        self._len += len(delta)
        self._text_cache = None

    def _configure(self, stop: StopStrings, include: bool) -> None:
        self._stop = list(stop.strings)
        self._stop_strings = stop
        self._stop_state = 0
        self._include = include
        self._max_stop = stop.max_len
        self._recent = self.decoded_text  # (trimmed after the caller's first search)
        self._recent_start = 0

    def _trim_recent(self) -> None:
        keep_from = min(self._emitted, max(0, self._len - (self._max_stop - 1)))
        if keep_from > self._recent_start:
            self._recent = self._recent[keep_from - self._recent_start :]
            self._recent_start = keep_from

    def _search(self, old_len: int) -> bool:
        """Compatibility mode, after new stop strings were adopted: run the text through their
        automaton, looking for a stop string ending after offset ``old_len``; on a match cut the
        text and finish. Returns True on a match."""
        text = self.decoded_text
        self._stop_state = self._stop_strings.feed(0, text[max(0, old_len - self._max_stop):old_len])[0]
        return self._feed(text[old_len:], old_len, report=True)

    def _feed(self, delta: str, old_len: int, report: bool) -> bool:
        """Advance the stop-string automaton over ``delta`` (the text from offset ``old_len``); with
        ``report``, the first stop string it completes cuts the text and finishes it (True)."""
        self._stop_state, end, stop = self._stop_strings.feed(self._stop_state, delta, report)
        if stop is None:
            return False
        cut = old_len + end if self._include else old_len + end - len(stop)
        full = self.decoded_text[:cut]
        self._chunks = [full] if full else []
        self._text_cache = full
        self._len = cut
        self._emitted = min(self._emitted, cut)
        self._recent = self._recent[: max(0, cut - self._recent_start)]
        self._stop_str = stop
        self._finished = True
        return True

    def _take(self, delta: str, final: bool) -> str:
        """Record decoded ``delta``, check stop strings, return the stream-safe new text."""
        old_len = self._len
        self._last_add_start = old_len
        if delta:
            self._append(delta)
        if not self._stop:
            self._emitted = self._len
            return delta

        self._recent += delta
        rs = self._recent_start
        if delta and self._feed(delta, old_len, report=self._num_output > self._min_tokens):
            out = self._recent[self._emitted - rs :]
            self._emitted = self._len
            return out

        hold = 0 if (final or self._include) else self._stop_strings.held(self._stop_state)
        safe_end = max(self._len - hold, self._emitted)
        out = self._recent[self._emitted - rs : safe_end - rs]
        self._emitted = safe_end
        self._trim_recent()
        return out


class StopStrings:
    """One Aho-Corasick automaton over a request's stop strings, built once (O(total length);
    SamplingParams.stop_strings) and shared by its sequences; each detokenizer keeps only its
    state, an int.

    A state is a node of the trie of the stop strings: the longest suffix of the text so far that
    is a prefix of some stop string. Feeding a character costs O(1) amortized (the failure links
    walked back are at most the characters fed before), whatever the number or length of the stop
    strings, where testing every stop string and every prefix length cost O(count x length^2) per
    token. The text held back for a possible stop string and the stop string a step completes
    are table lookups on the state."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.strings = tuple(dict.fromkeys(stops))
        self.max_len = max((len(s) for s in self.strings), default=0)
        # Compact, as a request may bring ~10^4 nodes (the server's limits: 64 stop strings of 256
        # characters): one dict of edges keyed node << 21 | code point (~100 bytes a node, a third
        # of a dict per node), int arrays for the per-node values.
        edges: dict[int, int] = {}
        parent, code, depth = array("i", [0]), array("i", [0]), array("i", [0])
        branches = bytearray(1)  # whether a node has children: a proper prefix of a stop string
        words: dict[int, str] = {}
        for s in self.strings:
            node = 0
            for ch in s:
                key = node << 21 | ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = edges[key] = len(parent)
                    parent.append(node)
                    code.append(ord(ch))
                    depth.append(depth[node] + 1)
                    branches.append(0)
                    branches[node] = 1
                node = nxt
            words[node] = s
        fail = array("i", bytes(4 * len(parent)))
        held = array("i", bytes(4 * len(parent)))
        matches: dict[int, str] = {}  # node -> the longest stop string its text ends with
        # Shallower nodes first: a node's failure link is shallower than the node.
        for node in sorted(range(1, len(parent)), key=depth.__getitem__):
            f = fail[parent[node]]
            if parent[node]:
                while f and (f << 21 | code[node]) not in edges:
                    f = fail[f]
                f = fail[node] = edges.get(f << 21 | code[node], 0)
            match = words.get(node, matches.get(f))
            if match is not None:
                matches[node] = match
            held[node] = depth[node] if branches[node] else held[f]
        self._edges, self._fail, self._matches, self._held = edges, fail, matches, held

    def __deepcopy__(self, memo) -> "StopStrings":
        return self  # immutable: a cloned SamplingParams shares it

    def feed(self, state: int, text: str, report: bool = False) -> tuple[int, int, str | None]:
        """(state after ``text``, end offset in ``text``, stop string) -- with ``report``, stopping at
        the first stop string completed (the earliest end; the longest there); else (state, 0, None)."""
        edges, fail, matches = self._edges, self._fail, self._matches
        for i, ch in enumerate(text):
            c = ord(ch)
            nxt = edges.get(state << 21 | c)
            while nxt is None and state:
                state = fail[state]
                nxt = edges.get(state << 21 | c)
            state = nxt or 0
            if report and state in matches:
                return state, i + 1, matches[state]
        return state, 0, None

    def held(self, state: int) -> int:
        """How many trailing characters may still begin a stop string (hold them back)."""
        return self._held[state]


def _as_list(stop: Sequence[str] | str | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    return list(dict.fromkeys(s for s in stop if s))


__all__ = ["IncrementalDetokenizer", "StopStrings", "Tokenizer"]
