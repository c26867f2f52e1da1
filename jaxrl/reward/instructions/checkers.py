"""IFEval's instruction checkers: ``check(response, **arguments) -> bool``, one per instruction id.

Each function follows the definition of the IFEval instruction it is named after (Zhou et al.,
2023, "Instruction-Following Evaluation for Large Language Models"), with IFEval's argument
names; ``jaxrl.reward.instructions.registry`` maps the ids to them and validates the arguments
before a checker sees them, so a checker may trust its arguments' types and ranges.
Deliberate differences from IFEval's code, each because a reward is trained against (a policy
finds what a checker lets through), are stated where they occur and in
docs/rewards.md#kind-instructions: keywords and section markers are literal text, never regular
expressions; a response without detectable language fails the language and case checks. Where
IFEval's regexes take quadratic time on some text, the same matches are found in one pass.
"""

from __future__ import annotations

import json
import re

from jaxrl.reward.instructions.text import cased_words, count_words, detect_language, split_paragraphs, split_sentences

LESS_THAN, AT_LEAST = "less than", "at least"
RELATIONS = (LESS_THAN, AT_LEAST)
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _compare(count: int, relation: str, threshold: int) -> bool:
    """IFEval's two relations: "less than" is count < threshold, "at least" is count >= threshold."""
    return count < threshold if relation == LESS_THAN else count >= threshold


def _literal(text: str) -> re.Pattern:
    # IFEval passes keywords to re.search as patterns; here "C++" or "$5" match as written and a
    # pattern from a data file cannot backtrack for ever.
    return re.compile(re.escape(text), re.IGNORECASE)


# --- keywords --------------------------------------------------------------------------------

def keywords_existence(response: str, *, keywords: list[str]) -> bool:
    """Every keyword occurs, case-insensitively, anywhere (also inside a longer word)."""
    return all(_literal(keyword).search(response) for keyword in keywords)


def keywords_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """The keyword's case-insensitive occurrences compare with ``frequency`` by ``relation``."""
    return _compare(len(_literal(keyword).findall(response)), relation, frequency)


def keywords_forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    """No forbidden word occurs as a whole word (between word boundaries), in any case."""
    return not any(re.search(rf"\b{re.escape(word)}\b", response, re.IGNORECASE) for word in forbidden_words)


def keywords_letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    """The letter's occurrences, either case, compare with ``let_frequency`` by ``let_relation``."""
    return _compare(response.lower().count(letter.lower()), let_relation, let_frequency)


# --- language and case -----------------------------------------------------------------------

def language_response_language(response: str, *, language: str) -> bool:
    """langdetect finds the whole response in ``language`` (an ISO 639-1 code such as "en").
    IFEval counts a response whose language cannot be detected as following; here it does not."""
    return detect_language(response) == language


def change_case_english_lowercase(response: str) -> bool:
    """The response is in English and has no capital letter (and at least one cased letter)."""
    return response.islower() and detect_language(response) == "en"


def change_case_english_capital(response: str) -> bool:
    """The response is in English and has no lower-case letter (and at least one cased letter)."""
    return response.isupper() and detect_language(response) == "en"


def change_case_capital_word_frequency(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    """The words written all in capitals ("NASA", "I", "WELL-KNOWN") compare with
    ``capital_frequency`` by ``capital_relation``."""
    return _compare(sum(word.isupper() for word in cased_words(response)), capital_relation, capital_frequency)


# --- length ----------------------------------------------------------------------------------

def length_number_words(response: str, *, num_words: int, relation: str) -> bool:
    """The words (runs of letters, digits, underscores) compare with ``num_words`` by ``relation``."""
    return _compare(count_words(response), relation, num_words)


def length_number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    """The sentences (``text.split_sentences``) compare with ``num_sentences`` by ``relation``."""
    return _compare(len(split_sentences(response)), relation, num_sentences)


def length_number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Exactly ``num_paragraphs`` paragraphs separated by the markdown divider ``***``; an empty
    paragraph between two dividers breaks the rule (one before the first or after the last does not)."""
    paragraphs = re.split(r"\s?\*\*\*\s?", response)
    inner = paragraphs[1:-1]
    if any(not paragraph.strip() for paragraph in inner):
        return False
    return sum(bool(paragraph.strip()) for paragraph in paragraphs) == num_paragraphs


def length_nth_paragraph_first_word(response: str, *, num_paragraphs: int, nth_paragraph: int,
                                    first_word: str) -> bool:
    """Exactly ``num_paragraphs`` paragraphs separated by blank lines, and paragraph ``nth_paragraph``
    (from 1) starts with ``first_word`` (case-insensitively; leading quotes and the punctuation after
    the word are ignored)."""
    paragraphs = split_paragraphs(response)
    if len(paragraphs) != num_paragraphs or nth_paragraph > len(paragraphs):
        return False
    word = paragraphs[nth_paragraph - 1].split()[0].lstrip("'\"")
    word = re.split(r"[.,?!'\"]", word, maxsplit=1)[0]
    return word.lower() == first_word.strip().lower()


# --- detectable content ----------------------------------------------------------------------

def content_number_placeholders(response: str, *, num_placeholders: int) -> bool:
    r"""At least ``num_placeholders`` placeholders in square brackets, such as ``[address]``, each on one line:
    what IFEval's ``re.findall(r"\[.*?\]")`` counts, found in one pass (that regex takes quadratic time
    on a line of unclosed brackets)."""
    found = 0
    for line in response.split("\n"):
        start = line.find("[")
        while start != -1 and (end := line.find("]", start + 1)) != -1:
            found += 1
            start = line.find("[", end + 1)
    return found >= num_placeholders


def content_postscript(response: str, *, postscript_marker: str) -> bool:
    """The postscript marker occurs, case-insensitively; "P.S." and "P.P.S" also with a space
    after a dot ("P. S.")."""
    text = response.lower()
    if postscript_marker == "P.P.S":
        return re.search(r"p\.\s?p\.\s?s", text) is not None
    if postscript_marker == "P.S.":
        return re.search(r"p\.\s?s\.", text) is not None
    return postscript_marker.lower() in text


# --- detectable format -----------------------------------------------------------------------

def format_number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    """Exactly ``num_bullets`` markdown bullet lines: lines starting with ``* `` (not ``**``) or ``-``."""
    # [ \t]* where IFEval has \s*: the same lines, without rescanning a run of blank lines from each of them.
    stars = re.findall(r"^[ \t]*\*[^*].*$", response, re.MULTILINE)
    dashes = re.findall(r"^[ \t]*-.*$", response, re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def format_constrained_response(response: str) -> bool:
    """The response holds one of IFEval's fixed answers: "My answer is yes.", "... no." or "... maybe."."""
    return any(answer in response for answer in CONSTRAINED_RESPONSES)


def format_number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """At least ``num_highlights`` markdown highlights, ``*text*`` or ``**text**``, non-blank and on one line."""
    single = [h for h in re.findall(r"\*[^\n*]*\*", response) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", response) if h[2:-2].strip()]
    return len(single) + len(double) >= num_highlights


def format_multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least ``num_sections`` sections, each started by the splitter word and a number
    ("SECTION 1"). The argument keeps IFEval's spelling, ``section_spliter``."""
    return len(re.split(rf"\s?{re.escape(section_spliter)}\s?\d+\s?", response)) - 1 >= num_sections


def format_json_format(response: str) -> bool:
    """The whole response is JSON, optionally in a markdown code fence (```json ... ```). JSON nested
    deeper than Python's parser can follow (thousands of ``[``) counts as not JSON."""
    text = response.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(fence)
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def format_title(response: str) -> bool:
    r"""A non-blank title in double angular brackets on one line, such as ``<<poem of joy>>``.

    IFEval's ``<<[^\n]+>>`` matches at most once per line, greedily from the line's first ``<<`` to its
    last ``>>``; this finds that span with ``find``/``rfind`` (the regex is quadratic on a line of ``<<``).
    """
    for line in response.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start != -1 and end > start and line[start:end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


# --- combination -----------------------------------------------------------------------------

def combination_two_responses(response: str) -> bool:
    """Two different responses separated by six asterisks ``******``, and nothing else."""
    parts = response.split("******")
    if any(not part.strip() for part in parts[1:-1]):
        return False
    answers = [part.strip() for part in parts if part.strip()]
    return len(answers) == 2 and answers[0] != answers[1]


def combination_repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    """The response starts with ``prompt_to_repeat`` word for word (case and surrounding space aside)."""
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


# --- start and end ---------------------------------------------------------------------------

def startend_end_checker(response: str, *, end_phrase: str) -> bool:
    """The response ends with ``end_phrase`` (case-insensitively; surrounding space and double quotes aside)."""
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def startend_quotation(response: str) -> bool:
    """The whole response is wrapped in double quotation marks."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# --- punctuation -----------------------------------------------------------------------------

def punctuation_no_comma(response: str) -> bool:
    """No comma "," at all."""
    return "," not in response
