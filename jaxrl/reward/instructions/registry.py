"""The instruction ids a row may name, each with its checker and the arguments it takes, and the
reading of a row's instructions into checks (IFEval's row format).

A row names its instructions in two parallel lists, as IFEval's data does: instruction ids
(``instruction_id_list``) and, at the same positions, each instruction's arguments as a mapping
(``kwargs``); the field names are the task's config. Arguments whose value is null are dropped,
because IFEval's published data gives every instruction every argument name, null where it takes
none. Anything else wrong (an unknown id, a missing or unknown argument, a value out of range)
is ``InputError`` naming the row field, the id and what is accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable, Mapping

from jaxrl.errors import InputError
from jaxrl.reward.instructions import checkers as c
from jaxrl.reward.instructions.text import LANGUAGE_CODES

# A validator returns an argument's value as the checker takes it, or raises ValueError saying what is accepted.
Validator = Callable[[Any], Any]


def _whole_number(value: Any, least: int) -> int:
    # Parquet holds a nullable integer column as floats (3.0 is 3); numpy's integers are integers;
    # a bool is an int to Python but never a count in a data file.
    whole = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
             or isinstance(value, float) and value.is_integer())
    if not whole or value < least:
        raise ValueError(f"accepted: a whole number >= {least}")
    return int(value)


def count(value: Any) -> int:
    return _whole_number(value, 0)


def position(value: Any) -> int:
    return _whole_number(value, 1)


def relation(value: Any) -> str:
    if value not in c.RELATIONS:
        raise ValueError(f"accepted: {' or '.join(map(repr, c.RELATIONS))}")
    return value


def text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("accepted: a non-blank string")
    return value


def texts(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError("accepted: a non-empty list of non-blank strings")
    return list(value)


def letter(value: Any) -> str:
    if not isinstance(value, str) or len(value.strip()) != 1 or not value.strip().isascii() \
            or not value.strip().isalpha():
        raise ValueError("accepted: one letter a-z")
    return value.strip()


def language(value: Any) -> str:
    if value not in LANGUAGE_CODES:
        raise ValueError(f"accepted: a language code langdetect knows, one of {sorted(LANGUAGE_CODES)}")
    return value


@dataclasses.dataclass(frozen=True)
class Instruction:
    """check(response, **arguments) -> followed; arguments: each argument's name -> its validator
    (every argument is required)."""

    check: Callable[..., bool]
    arguments: Mapping[str, Validator] = dataclasses.field(default_factory=dict)


INSTRUCTIONS: Mapping[str, Instruction] = {
    "keywords:existence": Instruction(c.keywords_existence, {"keywords": texts}),
    "keywords:frequency": Instruction(c.keywords_frequency,
                                      {"keyword": text, "frequency": count, "relation": relation}),
    "keywords:forbidden_words": Instruction(c.keywords_forbidden_words, {"forbidden_words": texts}),
    "keywords:letter_frequency": Instruction(c.keywords_letter_frequency,
                                             {"letter": letter, "let_frequency": count, "let_relation": relation}),
    "language:response_language": Instruction(c.language_response_language, {"language": language}),
    "length_constraints:number_sentences": Instruction(c.length_number_sentences,
                                                       {"num_sentences": count, "relation": relation}),
    "length_constraints:number_paragraphs": Instruction(c.length_number_paragraphs, {"num_paragraphs": position}),
    "length_constraints:number_words": Instruction(c.length_number_words, {"num_words": count, "relation": relation}),
    "length_constraints:nth_paragraph_first_word": Instruction(
        c.length_nth_paragraph_first_word, {"num_paragraphs": position, "nth_paragraph": position, "first_word": text}),
    "detectable_content:number_placeholders": Instruction(c.content_number_placeholders, {"num_placeholders": count}),
    "detectable_content:postscript": Instruction(c.content_postscript, {"postscript_marker": text}),
    "detectable_format:number_bullet_lists": Instruction(c.format_number_bullet_lists, {"num_bullets": count}),
    "detectable_format:constrained_response": Instruction(c.format_constrained_response),
    "detectable_format:number_highlighted_sections": Instruction(c.format_number_highlighted_sections,
                                                                 {"num_highlights": count}),
    "detectable_format:multiple_sections": Instruction(c.format_multiple_sections,
                                                       {"section_spliter": text, "num_sections": count}),
    "detectable_format:json_format": Instruction(c.format_json_format),
    "detectable_format:title": Instruction(c.format_title),
    "combination:two_responses": Instruction(c.combination_two_responses),
    "combination:repeat_prompt": Instruction(c.combination_repeat_prompt, {"prompt_to_repeat": text}),
    "startend:end_checker": Instruction(c.startend_end_checker, {"end_phrase": text}),
    "startend:quotation": Instruction(c.startend_quotation),
    "change_case:capital_word_frequency": Instruction(c.change_case_capital_word_frequency,
                                                      {"capital_frequency": count, "capital_relation": relation}),
    "change_case:english_capital": Instruction(c.change_case_english_capital),
    "change_case:english_lowercase": Instruction(c.change_case_english_lowercase),
    "punctuation:no_comma": Instruction(c.punctuation_no_comma),
}

Check = Callable[[str], bool]


def bind(instruction_id: str, arguments: Any, where: str) -> Check:
    """The check of instruction ``instruction_id`` (a key of ``INSTRUCTIONS``) with its arguments:
    ``check(response) -> followed``. where: how the arguments are named in an error (the row field
    and index). InputError for bad arguments.
    """
    instruction = INSTRUCTIONS[instruction_id]
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise InputError(f"{where} (the arguments of {instruction_id!r}) must be a mapping, got {arguments!r}")
    given = {name: value for name, value in arguments.items() if value is not None}
    takes = f"{instruction_id!r} takes {', '.join(instruction.arguments) or 'no arguments'}"
    unknown = sorted(map(str, set(given) - set(instruction.arguments)))
    missing = [name for name in instruction.arguments if name not in given]
    if unknown or missing:
        problems = [f"unknown {unknown}"] * bool(unknown) + [f"missing {missing}"] * bool(missing)
        raise InputError(f"{where}: arguments {' and '.join(problems)}; {takes}")
    valid = {}
    for name, validate in instruction.arguments.items():
        try:
            valid[name] = validate(given[name])
        except ValueError as e:
            raise InputError(f"{where}[{name!r}] of {instruction_id!r} is {given[name]!r}; {e}") from None
    return functools.partial(instruction.check, **valid)


def read_instructions(row: Mapping, ids_field: str, kwargs_field: str) -> list[tuple[str, Check]]:
    """The instructions a row names, as (id, check) pairs in the row's order; InputError naming the
    row field when the row's lists are missing, malformed or name something unknown. A row without
    ``kwargs_field`` (or with null) gives every instruction no arguments."""
    ids = row.get(ids_field)
    if ids_field not in row:
        raise InputError(f"row has no {ids_field!r} field (the ids of the instructions its response must follow); "
                         f"fields: {sorted(map(str, row))}")
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InputError(f"row field {ids_field!r} must be a non-empty list of instruction ids, got {ids!r}")
    all_arguments = row.get(kwargs_field)
    if all_arguments is None:
        all_arguments = [None] * len(ids)
    if not isinstance(all_arguments, (list, tuple)) or len(all_arguments) != len(ids):
        raise InputError(f"row field {kwargs_field!r} must be a list of {len(ids)} mappings, one per entry of "
                         f"{ids_field!r}, got {all_arguments!r}")
    checks = []
    for i, (instruction_id, arguments) in enumerate(zip(ids, all_arguments, strict=True)):
        if not isinstance(instruction_id, str) or instruction_id not in INSTRUCTIONS:
            raise InputError(f"row field {ids_field!r}[{i}] is {instruction_id!r}, not an instruction id this reward "
                             f"knows; accepted: {sorted(INSTRUCTIONS)}")
        checks.append((instruction_id, bind(instruction_id, arguments, f"row field {kwargs_field!r}[{i}]")))
    return checks
