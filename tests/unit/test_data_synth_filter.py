"""`synth_filter.repetition_loop`: degenerate text (a unit repeated back to back) in any script, its
bounds, and its `degenerate` count in `builtin:magpie`'s synthesis report (the other filters are
tested in tests/e2e/test_data_synth.py)."""

from __future__ import annotations

import itertools
import random
import string

import pytest

from hpctoolkit.data import synth
from hpctoolkit.data.config import DataConfig, MagpieConfig
from hpctoolkit.data.prompts import load_rows
from hpctoolkit.data.synth import Limits, fill_rows, report_line, request_seed
from hpctoolkit.data.synth_filter import (
    LOOP_COPIES,
    LOOP_MAX_UNIT,
    LOOP_SPAN,
    REASONS,
    TAIL_COPIES,
    TAIL_SPAN,
    Candidate,
    EvalIndex,
    answer_reason,
    degenerate,
    repetition_loop,
    select,
    turn_reason,
)
from hpctoolkit.data.template import ChatSpec
from hpctoolkit.targets.builtin import tiny_tokenizer

# --- loops are caught, in any script --------------------------------------------------------------

PARAGRAPH = (
    "The function returns the sum of the list. It loops over the items, adds each one to the total, "
    "and returns the total at the end of the loop. "
)
# (text, the repeated unit): answers cut at their token limit in the middle of a copy, mostly.
LOOPS = {
    "hebrew words": ("הנה התשובה לשאלה שלך: " + "שלום עולם, " * 20 + "שלו", "שלום עולם, "),
    "hebrew letter": ("התשובה היא " + "ה " * 60, "ה "),
    "arabic": ("الجواب هو: " + "شكرا جزيلا لك " * 12, "شكرا جزيلا لك "),
    "russian": ("Ответ: " + "это очень хорошо, " * 9 + "это", "это очень хорошо, "),
    "chinese phrase": ("这是问题的答案。" + "我们是好朋友。" * 9 + "我们", "我们是好朋友。"),
    "chinese character": ("答案：" + "的" * 45, "的"),
    "japanese": ("答えは" + "ありがとうございます。" * 5, "ありがとうございます。"),
    "korean": ("답변: " + "감사합니다 " * 10, "감사합니다 "),
    "emoji": ("Great job! " + "🎉" * 40, "🎉"),
    "punctuation": ("Wow" + "!" * 300, "!"),
    "english sentence": (
        "Sure, here is my answer. " + "I'm sorry, but I cannot help with that request. " * 5,
        "I'm sorry, but I cannot help with that request. ",
    ),
    "python line": ("def f(x):\n" + "    x = x + 1\n" * 12 + "    x = x", "    x = x + 1\n"),
    "markdown row": (
        "| Name | Score |\n|------|-------|\n" + "| Alice | 10 |\n" * 12,
        "| Alice | 10 |\n",
    ),
    "paragraph": ("Intro. " + PARAGRAPH * 4 + PARAGRAPH[:50], PARAGRAPH),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_loop_reaching_the_end_is_caught_in_any_script(name):
    text, unit = LOOPS[name]
    loop = repetition_loop(text)
    assert loop is not None and loop.tail, name
    b = text.strip().encode()
    # The unit found is the loop's, up to where it starts, and the loop runs to the end.
    assert len(unit.encode()) == loop.unit and b[loop.start : loop.start + loop.unit] in (unit * 2).encode()
    assert loop.copies >= TAIL_COPIES and loop.span >= TAIL_SPAN and loop.start + loop.span == len(b)


@pytest.mark.parametrize(
    "text",
    [
        "Ответ: " + "это очень хорошо, " * 16 + "\n\nНадеюсь, это помогло вам разобраться в вопросе.",
        "答案：" + "我们是好朋友。" * 13 + "\n\n希望这个回答对你有帮助，祝你学习顺利！",
        "Here:\n```python\n" + "print('hello world')\n" * 14 + "```\nThat prints it many times.",
        "Title " + "שלום עולם, " * 16 + "ובסוף משהו אחר לגמרי שאינו חוזר על עצמו.",
    ],
)
def test_a_loop_the_target_escaped_is_caught_too(text):
    loop = repetition_loop(text)
    assert loop is not None and not loop.tail
    assert loop.copies >= LOOP_COPIES and loop.span >= LOOP_SPAN


# --- legitimate text is kept ----------------------------------------------------------------------

PROSE = """Photosynthesis is the process by which green plants, algae and some bacteria turn light
into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light. That
energy splits water molecules, which releases oxygen, and drives the synthesis of ATP and NADPH.

The Calvin cycle then uses ATP and NADPH to fix carbon dioxide into three-carbon sugars. These
sugars build glucose, starch and cellulose. In short: light in, sugar and oxygen out. The rate
depends on light intensity, the concentration of carbon dioxide, and the temperature.

1. Light reactions happen in the thylakoid membranes.
2. The Calvin cycle happens in the stroma.
3. Both stages are needed, and both are regulated.

I hope this helps! Let me know if you have any other questions."""

CODE = '''```python
class Stack:
    """A last-in, first-out container."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, item: int) -> None:
        self.items.append(item)

    def pop(self) -> int:
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()


s = Stack()
s.push(1)
s.push(2)
s.push(3)
print(s.pop())
print(s.pop())
print(s.pop())
```

```c
int main(void) {
    for (int i = 0; i < 3; i++) {
        if (i % 2) {
            while (0) {
            }
        }
    }
    return 0;
}
```'''

TABLE = """| Planet  | Moons | Distance (AU) | Type        |
|---------|-------|---------------|-------------|
| Mercury | 0     | 0.39          | Terrestrial |
| Venus   | 0     | 0.72          | Terrestrial |
| Earth   | 1     | 1.00          | Terrestrial |
| Mars    | 2     | 1.52          | Terrestrial |
| Jupiter | 95    | 5.20          | Gas giant   |
| Saturn  | 146   | 9.58          | Gas giant   |
| Uranus  | 28    | 19.2          | Ice giant   |
| Neptune | 16    | 30.1          | Ice giant   |"""

KEPT = {
    "english prose": PROSE,
    "code": CODE,
    "markdown table": TABLE,
    "wide table separator": "| " + " | ".join(f"c{i}" for i in range(24)) + " |\n" + "|---" * 24 + "|",
    "blank table template": "| Name | Age | City |\n|------|-----|------|\n" + "|      |     |      |\n" * 3,
    "table ending on equal rows": TABLE + "\n| Pluto   | 5     | 39.5          | Dwarf       |" * 3,
    "short list": "Shopping list:\n- milk\n- milk\n- eggs\n- bread\n- bread\n- bread",
    "numbered list": "\n".join(f"{i}. Item number {i} of the list" for i in range(1, 41)),
    "rule": "Results\n" + "=" * 80 + "\nAll tests passed.\n" + "-" * 80,
    "rule at the end": "Results: all tests passed.\n" + "=" * 100,
    "hex constant": "The 128-bit mask is 0x" + "0" * 32 + ", and its inverse is 0x" + "f" * 32 + ".",
    "bits": "In binary, 0x5555 is " + "01" * 8 + " and 0xAAAA is " + "10" * 8 + ".",
    "laughing": "Hahahahahahahahaha, that is a good one! 😂😂😂😂",
    "closing parens": "(defun f (x) (if (> x 0) (g (h (k x))) (m (n x))))))",
    "refrain": "Chorus:\n" + "We will, we will rock you!\n" * 3 + "\nVerse two begins here.",
    "seven equal code lines": "def f():\n" + "    total = total + compute(12)\n" * 7 + "    return total",
    "hebrew prose": (
        "ירושלים היא עיר עתיקה בעלת היסטוריה ארוכה. העיר קדושה לשלוש דתות, ומושכת מבקרים מכל העולם. "
        "בעיר העתיקה יש ארבעה רבעים: הרובע היהודי, הרובע המוסלמי, הרובע הנוצרי והרובע הארמני."
    ),
    "chinese prose": (
        "北京是中国的首都，有三千多年的历史。故宫、长城和天坛都是著名的景点。"
        "每年都有很多游客来这里参观，了解中国的传统文化和历史。"
    ),
    "json": '{"users": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}]}',
    "empty": "",
}


@pytest.mark.parametrize("name", list(KEPT))
def test_legitimate_text_is_kept(name):
    assert repetition_loop(KEPT[name]) is None, name
    assert repetition_loop(KEPT[name] + "\n\n" + PROSE) is None, name


# --- the bounds, exactly --------------------------------------------------------------------------

UNIT = "0123456789abcdefghijklmnopqrstu;"  # 32 bytes, none of them in the text around it


def letters(n: int) -> str:
    """`n` random letters: a unit with no shorter period in it."""
    return "".join(random.Random(n).choices(string.ascii_letters, k=n))


def test_the_tail_bound_is_four_copies_and_128_bytes():
    assert len(UNIT) == 32 and TAIL_COPIES * 32 == TAIL_SPAN
    assert degenerate("Q: " + UNIT * 4)
    assert not degenerate("Q: " + UNIT * 3 + UNIT[:31])  # 3.97 copies, 127 bytes
    assert degenerate("Q: " + UNIT * 4 + "\n\n  ")  # trailing space is stripped
    assert not degenerate("Q: " + UNIT[:20] * 6)  # 6 copies but 120 bytes
    assert degenerate("Q: " + UNIT[:20] * 6 + UNIT[:8])  # 128 bytes
    assert not degenerate("Q: " + letters(100) * 3 + letters(100)[:99])  # 3.99 copies of 100 bytes
    assert degenerate("Q: " + letters(100) * 4)


def test_away_from_the_end_the_bounds_are_eight_copies_and_256_bytes():
    after = " and then something else entirely, which ends the answer."
    assert degenerate("Q: " + UNIT * 8 + after)
    assert not degenerate("Q: " + UNIT * 7 + UNIT[:31] + after)
    assert not degenerate("Q: " + UNIT[:31] * 8 + after)  # 248 bytes
    # The docstring's example: 8 equal 32-byte code lines in a row are flagged, 7 are not.
    line = "    total = total + compute(12)\n"
    assert len(line) == 32
    assert degenerate("def f():\n" + line * 8 + "    return total")
    assert not degenerate("def f():\n" + line * 7 + "    return total")


def test_units_up_to_the_longest():
    assert degenerate("Q: " + letters(LOOP_MAX_UNIT) * 4)
    assert not degenerate("Q: " + letters(LOOP_MAX_UNIT + 1) * 6)


def test_bytes_not_characters_are_counted():
    # 43 CJK characters are 129 bytes: a loop; 43 ASCII letters are 43 bytes: not.
    assert degenerate("答：" + "好" * 43) and not degenerate("A: " + "z" * 43)


def naive(text: str) -> bool:
    """The definition, unit by unit: every maximal run of b[i] == b[i + unit]."""
    b = text.strip().encode()
    for unit in range(1, LOOP_MAX_UNIT + 1):
        end = 0
        for equal, run in itertools.groupby(x == y for x, y in zip(b, b[unit:], strict=False)):
            end += (n := sum(1 for _ in run))
            span, tail = n + unit, end + unit == len(b)
            if equal and (
                (tail and span / unit >= TAIL_COPIES and span >= TAIL_SPAN)
                or (span / unit >= LOOP_COPIES and span >= LOOP_SPAN)
            ):
                return True
    return False


def test_the_anchored_search_finds_exactly_the_loops_the_definition_does():
    """Random texts of a few symbols (ASCII, Hebrew, CJK), with loops of random units, copies
    and places: `degenerate` agrees with the byte-by-byte definition on every one."""
    rng = random.Random(11)
    symbols = ["a", "b", " ", "\n", "ש", "ל", "的", "好", "{", "}"]
    agree = {True: 0, False: 0}
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(0, 3)):
            parts.append("".join(rng.choice(symbols) for _ in range(rng.randint(0, 120))))
            if rng.random() < 0.6:
                unit = "".join(rng.choice(symbols) for _ in range(rng.randint(1, 60)))
                parts.append(unit * rng.randint(2, 12) + unit[: rng.randint(0, len(unit))])
        text = "".join(parts)
        want = naive(text)
        assert degenerate(text) == want, text
        agree[want] += 1
    assert min(agree.values()) > 50  # both answers were tried often


# --- the reasons and the counts -------------------------------------------------------------------

HEBREW_LOOP = "מה זה " + "שלום עולם, " * 20


def test_turn_and_answer_reasons():
    assert turn_reason(True, 30, HEBREW_LOOP, min_tokens=3, max_tokens=400) == "degenerate"
    assert turn_reason(False, 30, HEBREW_LOOP, min_tokens=3, max_tokens=400) == "no_end"
    assert turn_reason(True, 500, HEBREW_LOOP, min_tokens=3, max_tokens=400) == "too_long"
    assert turn_reason(True, 30, "What is the capital of France?", 3, 400) == ""
    assert answer_reason("") == "bad_answer"
    assert answer_reason(LOOPS["chinese phrase"][0]) == "degenerate"
    assert answer_reason(PROSE) == answer_reason(CODE) == answer_reason(TABLE) == ""


def test_select_counts_degenerate_under_its_own_name():
    assert REASONS.index("degenerate") == REASONS.index("too_long") + 1
    cands = [
        Candidate(0, ["write a haiku about the autumn wind in the hills"]),
        Candidate(1, ["x"], reason="degenerate"),
        Candidate(2, ["y"], reason="degenerate"),
        Candidate(3, ["explain how a compiler turns source code into machine code"]),
    ]
    sel = select(cands, 2, EvalIndex([], 0.5), near_dup=0.7)
    assert sel.kept == [0, 3] and sel.dropped == {**dict.fromkeys(REASONS, 0), "degenerate": 2}


class Stand:
    """A stand-in target: user turn (candidate, turn) from `users`, its answer from `answers`,
    chosen by the request's seed."""

    def __init__(self, tok, seed, users, answers):
        self.tok, self.users, self.answers = tok, users, answers
        self.who = {
            request_seed(seed, i, t, w): (i, t, w)
            for i in range(64)
            for t in range(3)
            for w in ("user", "answer")
        }

    def __call__(self, prompts, max_tokens, seeds, **_):
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        out = []
        for m, s in zip(max_tokens, seeds, strict=True):
            i, t, what = self.who[s]
            text = (self.users if what == "user" else self.answers)(i, t)
            out.append(([*self.tok(text, add_special_tokens=False).input_ids, eot][:m], "stop"))
        return out


def distinct(i, t):
    r = random.Random(f"{i}:{t}")
    return f"question {i} turn {t}: " + " ".join(r.sample(PROSE.split(), 10))


def test_the_synthesis_report_counts_degenerate_rows(monkeypatch):
    """Candidate 1's user turn is a Hebrew loop, candidate 3's answer to its first turn a Chinese
    one: both are dropped as `degenerate`, counted in the report and its line."""
    monkeypatch.setattr(synth, "eval_texts", lambda: ({}, {}))
    tok = tiny_tokenizer()

    def users(i, t):
        return HEBREW_LOOP if (i, t) == (1, 0) else distinct(i, t)

    def answers(i, t):
        return LOOPS["chinese phrase"][0] if i == 3 else f"answer {i}.{t}"

    knobs = MagpieConfig(turns=2, seed=2, min_tokens=1, max_tokens=400, oversample=3)
    rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=400, magpie=knobs), 4)
    gen = Stand(tok, 2, users, answers)
    out, report = fill_rows(rows, tok, ChatSpec(), gen, Limits(400, 2048, 4096))
    assert [r["origin"].split("candidate ")[1] for r in out] == ["0)", "2)", "4)", "5)"]
    assert report is not None and report["dropped"] == {**dict.fromkeys(REASONS, 0), "degenerate": 2}
    assert report["candidates"] >= 6 and report["kept"] == 4
    assert "(dropped: degenerate 2;" in report_line(report)
