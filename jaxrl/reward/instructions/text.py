"""What the instruction checkers measure in a response: words, sentences, paragraphs, its language.

Each function is pure and offline. Two of them stand in for tools IFEval uses and say where they
differ (docs/rewards.md#kind-instructions):

- :func:`split_sentences` replaces nltk's punkt model, which a machine without network access to
  nltk's download server cannot fetch;
- :func:`detect_language` is langdetect (the detector IFEval uses), made deterministic.
"""

from __future__ import annotations

import functools
import os
import re

from langdetect import DetectorFactory, LangDetectException
from langdetect.detector_factory import PROFILES_DIRECTORY

_WORD = re.compile(r"\w+")
# A word as nltk's word_tokenize keeps it for case counts: letters and digits, joined by inner
# hyphens or apostrophes ("WELL-KNOWN" is one word).
_CASED_WORD = re.compile(r"[^\W_]+(?:[-'’][^\W_]+)*")
# A sentence ends at a run of ., ! or ? (with the closing quotes or brackets after it) that is
# followed by white space or the end of the text. Tried only where a run starts, and possessive
# (++, *+), so that a long run followed by a letter costs one pass, not one per character in it.
_SENTENCE_END = re.compile(r"(?<![.!?])[.!?]++[\"'”’)\]]*+(?=\s|\Z)")
# Words whose dot ends an abbreviation, not a sentence (lower case, without their last dot).
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf", "al", "fig", "no",
    "inc", "ltd", "co", "corp", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
    "dec", "u.s", "u.k", "a.m", "p.m",
})
_LOOK_BACK = 12
_BLANK_LINE = re.compile(r"\n\s*\n")


def count_words(text: str) -> int:
    """Runs of letters, digits and underscores, as IFEval counts words ("don't" is two)."""
    return len(_WORD.findall(text))


def cased_words(text: str) -> list[str]:
    """The words of ``text`` whose case can be judged (:data:`_CASED_WORD`)."""
    return _CASED_WORD.findall(text)


def _ends_abbreviation(text: str, dot: int) -> bool:
    """True when the "." at ``dot`` closes an abbreviation ("Dr.", "e.g.") or an initial ("J.")."""
    # The word before the dot, read from a few characters back: every abbreviation is shorter, and
    # reading back to the text's start at every dot would be quadratic.
    before = text[max(0, dot - _LOOK_BACK):dot]
    word = before.rsplit(None, 1)[-1] if before.strip() else ""
    word = word.lstrip("\"'“‘([").lower()
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text``, stripped, in order.

    A sentence ends at ".", "!" or "?" (or a run of them, "?!", "...") followed by white space or
    the end of the text, closing quotes and brackets included; a final piece without such an end
    is a sentence too. Limits, against nltk's punkt (which IFEval uses): a dot after a listed
    abbreviation (``_ABBREVIATIONS``: titles, "e.g.", "etc.", months...) or after a single letter
    (an initial) never ends a sentence, so "... ends with a b." is one sentence too few and an
    unlisted abbreviation ("approx. 5") one too many; a line break alone never ends one (a list of
    lines without final stops is one sentence, as in punkt); "1. " at the start of a numbered
    item ends a "sentence" "1.".
    """
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        if end.group() == "." and _ends_abbreviation(text, end.start()):
            continue
        piece = text[start:end.end()].strip()
        if piece:
            sentences.append(piece)
        start = end.end()
    rest = text[start:].strip()
    if rest:
        sentences.append(rest)
    return sentences


def split_paragraphs(text: str) -> list[str]:
    """The non-blank paragraphs of ``text``, separated by one or more blank lines, stripped."""
    return [p.strip() for p in _BLANK_LINE.split(text) if p.strip()]


LANGUAGE_CODES = frozenset(os.listdir(PROFILES_DIRECTORY))  # langdetect's 55 languages: "en", "zh-cn", ...


@functools.lru_cache(maxsize=1)
def _detectors() -> DetectorFactory:
    """langdetect's profiles, loaded once per process (about 0.4 s), with a fixed seed.

    A factory of our own rather than langdetect's global one, so that seeding it (langdetect
    samples n-grams at random) changes nothing for other users of langdetect in the process.
    """
    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(0)
    return factory


# A response's language is asked by up to three instructions, each over the same loose variants.
@functools.lru_cache(maxsize=32)
def detect_language(text: str) -> str | None:
    """The language code langdetect finds most likely for ``text`` ("en", "de", "zh-cn"...), the
    same for the same text on every call; None when the text has nothing to detect from (no letters).
    About 16 ms for 5,000 characters (langdetect reads at most 10,000)."""
    detector = _detectors().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None
