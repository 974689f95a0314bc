"""Reading a model's final answer out of what it writes, the way evaluation harnesses do.

A real model restates the question ("10 - 14 = -4"), explains ("To find it, ... The answer is 7."),
or wraps the answer (`\\boxed{7}`, `<answer>7</answer>`). An environment declares, in order, where
its answer may be read (`readers`); the first reader that finds one gives the answer, and a later
one is never asked. The first reader is the form the prompt asks for: an answer read by it is
*formatted*, which an optional format reward pays for (`AnswerConfig.format_reward`).

    only           the whole completion is the answer ("7", " 7.", "**7**")
    boxed          the content of the last \\boxed{...} (braces balanced)
    answer_tag     the content of the last <answer>...</answer>
    answer_is      what follows the last "answer is" / "answer:", to the end of its line
    after_equals   what follows the last "=", to the end of its line
    first_sentence the completion up to its first sentence end
    last_number    the last number anywhere (lm-eval's "flexible-extract")
    first_number   the first number anywhere (after a list's leading "1." marker: "1. 8 is larger")

A span reader (all but the two number readers) gives text; `read_number` takes the first number in
it ("= -4, since ..." reads -4).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from pydantic import Field

from environments.config import EnvironmentConfig

Reader = Literal[
    "only", "boxed", "answer_tag", "answer_is", "after_equals", "first_sentence", "last_number", "first_number"
]

# A number standing alone: "-4", "1,000", "2.5"; not the 2 of "x2" or "2nd".
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)")
_ANSWER_IS = re.compile(r"answer(?:\s+is|\s*:)\s*[:\-]?\s*([^\n]*)", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# "1. 8 is larger": a list's first marker before a number is not the answer.
_LIST_MARKER = re.compile(r"^\s*1[.)]\s+(?=-?\d)")
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)|\n")
# What a model puts around an answer that is all it wrote: spaces, markdown emphasis, a full stop.
_WRAPPING = " \t\n*_`\"'"


def _normalize(text: str) -> str:
    """Unicode minus signs and dashes as '-', so '−4' reads as -4."""
    return text.replace("\u2212", "-").replace("\u2013", "-")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text, braces matched; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def _only(text: str) -> str | None:
    stripped = text.strip(_WRAPPING).removesuffix(".").strip(_WRAPPING)
    return stripped or None


def _after_last(pattern: str) -> Callable[[str], str | None]:
    def read(text: str) -> str | None:
        if pattern not in text:
            return None
        return text.rsplit(pattern, 1)[1].split("\n", 1)[0].strip() or None

    return read


def _answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    return (found[-1].strip() or None) if found else None


def _answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _first_sentence(text: str) -> str | None:
    text = text.strip()
    end = _SENTENCE_END.search(text)
    return (text[: end.start()] if end else text).strip() or None


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(text)


READERS: dict[str, Callable[[str], str | None]] = {
    "only": _only,
    "boxed": last_boxed,
    "answer_tag": _answer_tag,
    "answer_is": _answer_is,
    "after_equals": _after_last("="),
    "first_sentence": _first_sentence,
    "last_number": lambda text: (_numbers(text) or [None])[-1],
    "first_number": lambda text: (_numbers(_LIST_MARKER.sub("", text, count=1)) or [None])[0],
}


@dataclass(frozen=True)
class Reading:
    """The answer a completion gives: the span read, and which reader read it (None: none found)."""

    text: str | None
    reader: str | None

    def formatted(self, readers: Sequence[str]) -> bool:
        """Read by the first reader: the answer came in the form the prompt asks for."""
        return self.reader is not None and self.reader == readers[0]


AnswerKind = Literal["number", "text"]
SHORT_ANSWER_WORDS = 4  # "Buenos Aires", "Santiago de Chile": an answer alone, not a sentence


def _holds_answer(span: str, reader: str, kind: AnswerKind) -> bool:
    """Whether a reader's span is an answer of this kind: for numbers a span with a number in it
    (`only`: nothing but one number); for text any span (`only`: a short one, not a sentence)."""
    if kind == "number":
        return bool(_NUMBER.fullmatch(span)) if reader == "only" else bool(_numbers(span))
    return reader != "only" or ("\n" not in span and len(span.split()) <= SHORT_ANSWER_WORDS)


def read_answer(completion: str, readers: Sequence[str], kind: AnswerKind = "number") -> Reading:
    """The span the first of `readers` that finds an answer of `kind` gives, and that reader's name."""
    completion = _normalize(completion)
    for name in readers:
        found = READERS[name](completion)
        if found is not None and _holds_answer(found, name, kind):
            return Reading(found, name)
    return Reading(None, None)


def parse_number(text: str) -> Fraction | None:
    """The first number in text as an exact fraction ('1,000' is 1000, '2.50' is 5/2); None if none."""
    found = _numbers(_normalize(text))
    return Fraction(found[0].replace(",", "")) if found else None


def number_matches(expected: int | float | str) -> Callable[[str], bool]:
    """A check that an answer span's first number equals `expected`."""
    target = Fraction(str(expected))

    def matches(span: str) -> bool:
        value = parse_number(span)
        return value is not None and value == target

    return matches


class AnswerConfig(EnvironmentConfig):
    """The knobs of an environment whose answers are read (environments.answers): where to read
    them, and what a well-formatted answer earns."""

    readers: list[Reader] | None = Field(
        default=None,
        min_length=1,
        description="Where the answer is read, in order (only, boxed, answer_tag, answer_is, after_equals, "
        "first_sentence, last_number, first_number); the first that finds one gives the answer, and the "
        "first of all is the form the prompt asks for. None: the environment's own.",
    )
    format_reward: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Added to the score of an answer in the form the prompt asks for (read by the first "
        "reader), right or wrong: a format reward. 0: the score is correctness alone.",
    )


def graded(
    completion: str,
    readers: Sequence[str],
    matches: Callable[[str], bool],
    format_reward: float = 0.0,
    kind: AnswerKind = "number",
) -> float:
    """1.0 for a right answer (the span read matches), plus format_reward when it was formatted."""
    reading = read_answer(completion, readers, kind)
    correct = reading.text is not None and matches(reading.text)
    return float(correct) + (format_reward if reading.formatted(readers) else 0.0)
