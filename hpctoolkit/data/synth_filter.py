"""What `builtin:magpie` keeps of the user turns the target wrote: pure, deterministic filtering.

A candidate is a synthesized conversation's user turns (`Candidate`). It is dropped, with the
first reason that applies, when a turn
  * `no_end`: never reached an end-of-turn token within its budget;
  * `too_short` / `too_long`: is empty or shorter than `min_tokens`, or longer than `max_tokens`
    (target tokens), or its history no longer fits the prompt length;
  * `degenerate`: it, or (not the last turn) the target's answer to it, holds a repetition loop
    (`repetition_loop`: a short unit of bytes repeated back to back, in any script; the answer
    to the last turn is regeneration's, not seen here);
  * `bad_answer`: (not the last turn) the target's answer to it came back empty or did not fit;
  * `eval_copy`: is an evaluation question, exactly or nearly: its normalised text equals one, or
    the word 5-grams of the shorter of the two lie in the other's at `eval_overlap` or more
    (containment), against every installed evaluation set's user turns (`eval_texts`);
and, for the first user turn, against the candidates kept before it,
  * `exact_dup`: the same text once case and whitespace are normalised;
  * `near_dup`: word 5-gram Jaccard at `near_dup` or more (exact, through prefix filtering: two
    sets with Jaccard >= t share a gram among the first `|s| - ceil(t |s|) + 1` of each in a
    fixed order).
`select` walks the candidates in index order and keeps the first `n` that pass, so the kept rows
of a larger pool begin with those of a smaller one, and equal inputs give equal outputs.
Text shorter than 5 words is one gram, the whole of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

NGRAM = 5
REASONS = (
    "no_end",
    "too_short",
    "too_long",
    "degenerate",
    "bad_answer",
    "eval_copy",
    "exact_dup",
    "near_dup",
)
_WORD = re.compile(r"\w+")
_EPS = 1e-9

Gram = tuple[str, ...]


def normalise(text: str) -> str:
    """Case folded, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.casefold().split())


def grams(text: str, n: int = NGRAM) -> frozenset[Gram]:
    words = _WORD.findall(text.casefold())
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[Gram], b: frozenset[Gram]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def containment(a: frozenset[Gram], b: frozenset[Gram]) -> float:
    """How much of the smaller set lies in the other."""
    small = min(len(a), len(b))
    return len(a & b) / small if small else 0.0


# --- degenerate text: repetition loops (`repetition_loop` says why these bounds) ----------------
LOOP_MAX_UNIT = 200  # bytes: a long sentence, a few lines of code
TAIL_COPIES = 4.0  # a loop that reaches the end of the text
TAIL_SPAN = 128  # bytes
LOOP_COPIES = 8.0  # a loop anywhere
LOOP_SPAN = 256  # bytes
# Anchors every _STRIDE bytes: a window [j, j + _STRIDE) found again `unit` bytes later marks a
# run, then extended both ways. A qualifying run is span * (copies - 1) / copies bytes long at
# least (96 at the tail), so it holds a whole aligned window if that is >= 2 * _STRIDE - 1.
_STRIDE = 32
_BLOCK = 32
if min(TAIL_SPAN * (TAIL_COPIES - 1) / TAIL_COPIES, LOOP_SPAN * (LOOP_COPIES - 1) / LOOP_COPIES) < (
    2 * _STRIDE - 1
):
    raise AssertionError("the loop bounds are too low for the anchor stride: lower _STRIDE")


@dataclass(frozen=True)
class Loop:
    """A repetition loop in a text's UTF-8 bytes: `span` bytes from `start`, a `unit` of bytes
    repeated (`copies` = span / unit), `tail` when it runs to the end of the text."""

    start: int
    unit: int
    span: int
    tail: bool

    @property
    def copies(self) -> float:
        return self.span / self.unit

    def qualifies(self) -> bool:
        if self.tail and self.copies >= TAIL_COPIES and self.span >= TAIL_SPAN:
            return True
        return self.copies >= LOOP_COPIES and self.span >= LOOP_SPAN


def _run(b: bytes, unit: int, j: int) -> tuple[int, int]:
    """The maximal [a, e) around [j, j + _STRIDE) with b[i] == b[i + unit] for every a <= i < e."""
    n, e, a = len(b), j + _STRIDE, j
    while e + unit + _BLOCK <= n and b[e : e + _BLOCK] == b[e + unit : e + unit + _BLOCK]:
        e += _BLOCK
    while e + unit < n and b[e] == b[e + unit]:
        e += 1
    while a >= _BLOCK and b[a - _BLOCK : a] == b[a - _BLOCK + unit : a + unit]:
        a -= _BLOCK
    while a > 0 and b[a - 1] == b[a - 1 + unit]:
        a -= 1
    return a, e


def repetition_loop(text: str) -> Loop | None:
    """The first repetition loop that makes `text` degenerate, or None.

    A loop is a unit of 1..`LOOP_MAX_UNIT` (200) bytes of the stripped text's UTF-8 written back
    to back: a maximal run of `b[i] == b[i + unit]`, whose span (run + unit) counts a partial last
    copy, as an answer cut at its token limit in the middle of one has. Degenerate:
      * at the tail, a loop that reaches the end of the text: `TAIL_COPIES` (4) copies over
        `TAIL_SPAN` (128) bytes or more;
      * anywhere: `LOOP_COPIES` (8) copies over `LOOP_SPAN` (256) bytes or more.

    Why bytes: they need no tokenizer and no word boundaries (Hebrew, CJK, code, emoji), and a
    byte is a steadier stand-in for a target token than a character is. In a byte-level BPE
    trained mostly on English and code, such as SmolLM2's, a token is about 4 bytes of English,
    about one Hebrew letter (2 bytes), and a CJK character (3 bytes) is one to three tokens.

    Why these bounds: a small target that starts to loop while decoding greedily loops until its
    token limit, so the loop that matters reaches the end, cut inside a copy. 128 bytes are about
    30 tokens of English and 40 to 130 of Hebrew or CJK; 4 copies of a 100-byte sentence, about
    100 tokens: a loop is caught well before it fills a 512-token answer (the acceptance ladder's
    `data.regenerate_tokens`). Text rarely says the same thing verbatim four times in a row, and
    more rarely still at its very end (a conclusion, a closing fence, the last item of a list).
    4 copies keep a line, a refrain or a table row said two or three times; 128 bytes keep short
    runs: "hahaha", "))))", a rule of 80 `=`, a 128-bit `0x000...0`, a blank table of three rows.
    Away from the end, the target looped and escaped, and repeated code lines or table rows are
    likelier there, so the bounds double: 8 equal 32-byte code lines in a row are flagged, 7 are
    not. A unit longer than 200 bytes (a whole paragraph) fits too few copies in an answer's
    budget to be told from text that quotes itself. Of 28k chunks of 2,000 characters from the
    Python, Markdown and text files installed in the project's venv, and 1.8k from this
    repository's, one was flagged: a progress bar of 97 `█`.

    Only exact repeats count: copies that differ (a counter, punctuation that varies) pass.
    Cost: one `bytes.find` per 32 bytes of text, plus extending each run it finds: tens of
    microseconds for a thousand characters.
    """
    b = text.strip().encode("utf-8")
    n = len(b)
    known: dict[int, tuple[int, int]] = {}  # unit -> the last run found for it
    for j in range(0, n - _STRIDE, _STRIDE):
        window, end = b[j : j + _STRIDE], j + LOOP_MAX_UNIT + _STRIDE
        at = b.find(window, j + 1, end)
        while at != -1:
            unit, at = at - j, b.find(window, at + 1, end)
            run = known.get(unit)
            if run is None or not run[0] <= j < run[1]:
                run = known[unit] = _run(b, unit, j)
                loop = Loop(run[0], unit, run[1] - run[0] + unit, run[1] + unit == n)
                if loop.qualifies():
                    return loop
    return None


def degenerate(text: str) -> bool:
    """Whether `text` holds a repetition loop (`repetition_loop`)."""
    return repetition_loop(text) is not None


def answer_reason(content: str) -> str:
    """Why the target's answer to a (not last) synthesized turn is unusable ("" if it is usable)."""
    if not content:
        return "bad_answer"
    return "degenerate" if degenerate(content) else ""


def turn_reason(ended: bool, num_tokens: int, text: str, min_tokens: int, max_tokens: int) -> str:
    """Why one synthesized user turn is unusable on its own ("" if it is usable)."""
    if not ended:
        return "no_end"
    if not text.strip() or num_tokens < min_tokens:
        return "too_short"
    if num_tokens > max_tokens:
        return "too_long"
    return "degenerate" if degenerate(text) else ""


class NearDupIndex:
    """The gram sets kept so far; `find(s)` says whether one has Jaccard >= `bound` with `s`."""

    def __init__(self, bound: float) -> None:
        if not 0 < bound <= 1:
            raise ValueError(f"near-duplicate bound must lie in (0, 1], got {bound}")
        self.bound = bound
        self._sets: list[frozenset[Gram]] = []
        self._postings: dict[Gram, list[int]] = {}

    def _prefix(self, s: frozenset[Gram]) -> list[Gram]:
        return sorted(s)[: len(s) - math.ceil(self.bound * len(s) - _EPS) + 1]

    def find(self, s: frozenset[Gram]) -> bool:
        seen: set[int] = set()
        for g in self._prefix(s):
            for j in self._postings.get(g, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(s, self._sets[j]) >= self.bound - _EPS:
                        return True
        return False

    def add(self, s: frozenset[Gram]) -> None:
        if not s:
            return
        self._sets.append(s)
        for g in self._prefix(s):
            self._postings.setdefault(g, []).append(len(self._sets) - 1)


class EvalIndex:
    """Evaluation questions; `is_copy(text)` when `text` is one, exactly or nearly (see the docstring)."""

    def __init__(self, texts: Iterable[str], bound: float) -> None:
        if not 0 < bound <= 1:
            raise ValueError(f"eval-overlap bound must lie in (0, 1], got {bound}")
        self.bound = bound
        self._exact: set[str] = set()
        self._sets: list[frozenset[Gram]] = []
        self._postings: dict[Gram, list[int]] = {}
        for t in texts:
            self._exact.add(normalise(t))
            s = grams(t)
            if s:
                self._sets.append(s)
                for g in s:
                    self._postings.setdefault(g, []).append(len(self._sets) - 1)

    def __len__(self) -> int:
        return len(self._exact)

    def is_copy(self, text: str) -> bool:
        if normalise(text) in self._exact:
            return True
        s = grams(text)
        overlap: dict[int, int] = {}
        for g in s:
            for j in self._postings.get(g, ()):
                overlap[j] = overlap.get(j, 0) + 1
        return any(k / min(len(s), len(self._sets[j])) >= self.bound - _EPS for j, k in overlap.items())


@dataclass
class Candidate:
    """One synthesized conversation: its user turns, the answers to all but the last, and why it
    was dropped before selection ("" while usable)."""

    index: int
    turns: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class Selection:
    kept: list[int]  # candidate positions, in order
    dropped: dict[str, int]  # reason -> count, every reason present
    examined: int  # candidates looked at (the rest were not needed)


def select(candidates: Sequence[Candidate], n: int, evals: EvalIndex, near_dup: float) -> Selection:
    """The first `n` candidates (in order) that pass every filter, and what was dropped and why."""
    dropped = dict.fromkeys(REASONS, 0)
    kept: list[int] = []
    seen: set[str] = set()
    near = NearDupIndex(near_dup)
    examined = 0
    for pos, c in enumerate(candidates):
        if len(kept) == n:
            break
        examined += 1
        reason = c.reason or ("eval_copy" if any(evals.is_copy(t) for t in c.turns) else "")
        if not reason:
            key = normalise(c.turns[0])
            s = grams(c.turns[0])
            reason = "exact_dup" if key in seen else "near_dup" if near.find(s) else ""
            if not reason:
                seen.add(key)
                near.add(s)
                kept.append(pos)
                continue
        dropped[reason] += 1
    return Selection(kept, dropped, examined)


def _questions(loader: Callable[[int], list], per_category: int) -> list[str]:
    return [t for q in loader(per_category) for t in q.turns]


def eval_texts(
    loaders: Mapping[str, Callable[[int], list]] | None = None,
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Every installed evaluation set's user turns (`evaluate.sets.LOADERS`: MT-Bench's 80
    questions, both turns; HumanEval's 164 prompts), and the sets that are not installed with why.
    A set whose file is malformed fails closed (its loader raises)."""
    from hpctoolkit.errors import ConfigError
    from hpctoolkit.evaluate import mt_bench

    if loaders is None:
        from hpctoolkit.evaluate.sets import LOADERS

        loaders = LOADERS
    found: dict[str, list[str]] = {}
    missing: dict[str, str] = {}
    for name, loader in loaders.items():
        try:
            found[name] = _questions(loader, mt_bench.PER_CATEGORY)
        except ConfigError as err:  # the set's wheel is not installed
            missing[name] = str(err)
    return found, missing
