"""kind: instructions: every IFEval instruction against hand-made responses that follow it and
responses that do not, strict and loose scoring, bad rows, the config, and the trainer's path
(a YAML config, the data loader's row check, the sandboxed router)."""

import json
import logging
import re
import time

import numpy as np
import pytest

from jaxrl.config import ConfigError, from_dict, load_config
from jaxrl.errors import InputError
from jaxrl.reward import RewardConfig, RewardResult, build_router
from jaxrl.reward.instructions import INSTRUCTIONS, InstructionsConfig, InstructionsReward, followed, loose_variants
from jaxrl.reward.instructions.text import detect_language, split_sentences

AT_LEAST, LESS_THAN = "at least", "less than"

# (instruction id, its arguments, a response, does the response follow the instruction?)
CASES = [
    ("keywords:existence", {"keywords": ["river", "C++"]}, "I write C++ by the River.", True),
    ("keywords:existence", {"keywords": ["river", "C++"]}, "I write C by the river.", False),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AT_LEAST}, "A cat saw a CAT.", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": AT_LEAST}, "A cat slept.", False),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": LESS_THAN}, "A cat slept.", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": LESS_THAN}, "cat and cat", False),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "awful"]}, "A badge, badly made.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "awful"]}, "That was Awful.", False),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": AT_LEAST}, "Zig zag zoo", True),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": AT_LEAST}, "Zig zag", False),
    ("keywords:letter_frequency", {"letter": "A", "let_frequency": 2, "let_relation": LESS_THAN}, "a cow", True),
    ("keywords:letter_frequency", {"letter": "A", "let_frequency": 2, "let_relation": LESS_THAN}, "banana", False),
    ("language:response_language", {"language": "de"},
     "Das ist ein kurzer Satz, der auf Deutsch geschrieben ist und vom Wetter handelt.", True),
    ("language:response_language", {"language": "de"},
     "This is a short sentence written in English about the weather.", False),
    ("language:response_language", {"language": "de"}, "12345 !!!", False),  # nothing to detect: not followed
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS_THAN}, "One. Two!", True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS_THAN}, "One. Two! Three?", False),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": AT_LEAST},
     "Dr. Smith came. He sat. He left.", True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": AT_LEAST},
     "Dr. Smith came. He left.", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\nSecond part.", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\nFirst part.\n***\nSecond.\n***", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\n***\nSecond part.", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n\nSecond part.", False),
    ("length_constraints:number_words", {"num_words": 5, "relation": AT_LEAST}, "one two three four five", True),
    ("length_constraints:number_words", {"num_words": 5, "relation": AT_LEAST}, "one two three four", False),
    ("length_constraints:number_words", {"num_words": 4, "relation": LESS_THAN}, "don't stop", True),  # 3 words
    ("length_constraints:number_words", {"num_words": 4, "relation": LESS_THAN}, "don't stop now", False),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     'Intro here.\n\n"However, it rains."', True),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "Intro here.\n\nBut it rains.", False),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "Intro.\n\nHowever it rains.\n\nA third one.", False),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Send it to [name] at [address].", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Send it to [name].", False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Thanks!\np. s. see you", True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Thanks! PS see you", False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Bye.\nP.P.S. one more", True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Bye.\nP.S. one more", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Items:\n* apple\n  - pear", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Items:\n* apple\n* pear\n* plum", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "**Bold** line\n* apple", False),
    ("detectable_format:constrained_response", {}, "I thought about it. My answer is maybe.", True),
    ("detectable_format:constrained_response", {}, "My answer is perhaps.", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and * *", False),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nIntro\nSection 2\nBody", True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nIntro\nPart 2\nBody", False),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True),
    ("detectable_format:json_format", {}, "[1, 2]", True),
    ("detectable_format:json_format", {}, "{'a': 1}", False),
    ("detectable_format:json_format", {}, 'Here it is: {"a": 1}', False),
    ("detectable_format:title", {}, "<<A Poem>>\nroses", True),
    ("detectable_format:title", {}, "<< >>\nroses", False),
    ("detectable_format:title", {}, "<A Poem>\nroses", False),
    ("combination:two_responses", {}, "Yes.\n******\nNo.", True),
    ("combination:two_responses", {}, "Yes.\n******\nYes.", False),
    ("combination:two_responses", {}, "a ****** b ****** c", False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku."}, "write a haiku. Leaves fall.", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku."}, "Here is a haiku: leaves fall.", False),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Done. any other questions?"  ', True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Bye.", False),
    ("startend:quotation", {}, '"Hello there."', True),
    ("startend:quotation", {}, 'Hello "there"', False),
    ("startend:quotation", {}, '"', False),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": AT_LEAST},
     "NASA and the WELL-KNOWN ESA", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": AT_LEAST},
     "Nasa and the well-known ESA", False),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": LESS_THAN}, "I like it", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": LESS_THAN}, "I LIKE it", False),
    ("change_case:english_capital", {}, "THIS IS A SHORT ANSWER WRITTEN IN ENGLISH ABOUT THE WEATHER.", True),
    ("change_case:english_capital", {}, "THIS IS A SHORT ANSWER WRITTEN IN ENGLISH ABOUT THE Weather.", False),
    ("change_case:english_capital", {}, "DAS IST EIN KURZER SATZ AUF DEUTSCH ÜBER DAS WETTER.", False),
    ("change_case:english_lowercase", {}, "this is a short answer written in english about the weather.", True),
    ("change_case:english_lowercase", {}, "This is a short answer written in English about the weather.", False),
    ("change_case:english_lowercase", {}, "esto es una respuesta corta escrita en español sobre el tiempo.", False),
    ("punctuation:no_comma", {}, "No commas here.", True),
    ("punctuation:no_comma", {}, "One, two.", False),
]


def _row(*instructions):
    """A row in IFEval's format from (id, arguments) pairs."""
    return {"instruction_id_list": [i for i, _ in instructions], "kwargs": [a for _, a in instructions]}


def _strict(response, row):
    return followed(response, row, InstructionsConfig())


def _loose(response, row):
    return followed(response, row, InstructionsConfig(mode="loose"))


@pytest.mark.parametrize("instruction, arguments, response, expected", CASES,
                         ids=[f"{c[0]}-{c[3]}-{n}" for n, c in enumerate(CASES)])
def test_instruction_checker(instruction, arguments, response, expected):
    assert _strict(response, _row((instruction, arguments))) == [expected]


def test_every_instruction_has_a_following_and_a_breaking_example():
    kinds = {(instruction, expected) for instruction, _, _, expected in CASES}
    assert {instruction for instruction, _ in kinds} == set(INSTRUCTIONS)
    assert kinds == {(instruction, expected) for instruction in INSTRUCTIONS for expected in (True, False)}
    assert len(INSTRUCTIONS) >= 20


@pytest.mark.parametrize("text", ["[a] [b [c]] [\nd] [e", "[[x]]] ]", "<<a>> <<b>>", "<<<>>", "a>> <<b", "<<x>>>\n<<",
                                  "<< >> <<y>>", "<<><>>", "<<\n>>"])
def test_placeholders_and_titles_are_what_ifevals_regexes_find(text):
    # IFEval's definitions are these regexes; the checkers find the same without their quadratic time.
    placeholders = len(re.findall(r"\[.*?\]", text))
    titled = any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))
    for n in (placeholders, placeholders + 1):
        assert _strict(text, _row(("detectable_content:number_placeholders", {"num_placeholders": n}))) == [
            placeholders >= n]
    assert _strict(text, _row(("detectable_format:title", {}))) == [titled]


def test_adversarial_responses_take_linear_time():
    every = _row(*{instruction: arguments for instruction, arguments, _, _ in CASES}.items())
    for text in ("[" * 100_000, "<<" * 50_000, "\n" * 100_000 + "- x", " \n" * 50_000 + "* x", "*" * 100_000,
                 "." * 100_000 + "x", "Dr. " * 25_000):
        start = time.perf_counter()
        results = _strict(text, every)
        assert time.perf_counter() - start < 5.0, text[:4]  # quadratic scans take minutes on these
        assert len(results) == len(INSTRUCTIONS)
    assert _strict("[" * 100_000, _row(("detectable_format:json_format", {}))) == [False]  # too deep: not JSON


@pytest.mark.parametrize("text, sentences", [
    ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
    ("Dr. Smith met J. Doe at 3.5 km, e.g. near St. Paul. Done...", ["Dr. Smith met J. Doe at 3.5 km, e.g. near St. "
                                                                    "Paul.", "Done..."]),
    ('He said "Stop." Then left?! Yes.', ['He said "Stop."', "Then left?!", "Yes."]),
    ("a list\nwithout stops\n", ["a list\nwithout stops"]),
    ("   ", []),
])
def test_split_sentences(text, sentences):
    assert split_sentences(text) == sentences


def test_language_detection_is_the_same_on_every_call():
    # langdetect unseeded answers "nl" or "no" for this text at random; __wrapped__ skips the cache.
    assert len({detect_language.__wrapped__("Hello Welt") for _ in range(20)}) == 1


def test_loose_variants_are_ifevals_eight():
    assert loose_variants("*a*\nb\nc") == ["*a*\nb\nc", "b\nc", "*a*\nb", "b", "a\nb\nc", "b\nc", "a\nb", "b"]
    assert loose_variants("one line") == ["one line"] * 2  # the cut variants are blank and dropped


@pytest.mark.parametrize("instruction, arguments, response", [
    ("startend:end_checker", {"end_phrase": "Bye."}, "Sure, bye.\nHope this helps!"),  # a closing remark
    ("detectable_format:json_format", {}, 'Sure, here it is:\n{"a": 1}'),  # a preamble
    ("startend:quotation", {}, '**"Hello there."**'),  # markdown emphasis
])
def test_loose_forgives_what_strict_does_not(instruction, arguments, response):
    row = _row((instruction, arguments))
    assert _strict(response, row) == [False] and _loose(response, row) == [True]


def test_a_blank_response_follows_nothing():
    row = _row(("punctuation:no_comma", {}), ("keywords:forbidden_words", {"forbidden_words": ["x"]}))
    assert _strict("  \n", row) == [False, False] and _loose("  \n", row) == [False, False]


def test_fraction_and_all():
    row = _row(("punctuation:no_comma", {}),
               ("length_constraints:number_words", {"num_words": 3, "relation": AT_LEAST}),
               ("startend:end_checker", {"end_phrase": "thanks"}))
    fraction, every = InstructionsReward(InstructionsConfig()), InstructionsReward(InstructionsConfig(aggregate="all"))
    two_of_three = "one two three, thanks"
    assert fraction("p", two_of_three, [], row) == RewardResult(pytest.approx(2 / 3), False)
    assert every("p", two_of_three, [], row) == RewardResult(0.0, False)
    all_three = "one two three thanks"
    assert fraction("p", all_three, [], row).score == every("p", all_three, [], row).score == 1.0


def test_ifeval_rows_with_null_arguments_and_parquet_floats():
    # IFEval's published rows give every argument name, null where the instruction takes none;
    # parquet reads a nullable integer column back as floats.
    nulls = {"num_words": None, "relation": None, "keywords": None, "language": None}
    row = _row(("punctuation:no_comma", dict(nulls)),
               ("length_constraints:number_words", {**nulls, "num_words": 2.0, "relation": AT_LEAST}),
               ("length_constraints:number_words", {**nulls, "num_words": np.int64(3), "relation": LESS_THAN}))
    assert _strict("two words", row) == [True, True, True]
    assert _strict("one", {"instruction_id_list": ["punctuation:no_comma"]}) == [True]  # no kwargs field: none


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p"}, r"row has no 'instruction_id_list' field .*fields: \['prompt'\]"),
    ({"instruction_id_list": "punctuation:no_comma"}, r"'instruction_id_list' must be a non-empty list"),
    ({"instruction_id_list": []}, r"'instruction_id_list' must be a non-empty list"),
    (_row(("punctuation:no_comma", {}), ("keywords:existance", {})),
     r"'instruction_id_list'\[1\] is 'keywords:existance', not an instruction id .*accepted: \[.*'keywords:existence'"),
    ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]},
     r"'kwargs' must be a list of 1 mappings, one per entry of 'instruction_id_list'"),
    (_row(("punctuation:no_comma", "x")), r"'kwargs'\[0\] \(the arguments of 'punctuation:no_comma'\) must be a map"),
    (_row(("length_constraints:number_words", {"num_words": 3})),
     r"'kwargs'\[0\]: arguments missing \['relation'\]; 'length_constraints:number_words' takes num_words, relation"),
    (_row(("punctuation:no_comma", {"num_words": 3})), r"arguments unknown \['num_words'\]; .* takes no arguments"),
    (_row(("length_constraints:number_words", {"num_words": 3, "relation": "more than"})),
     r"'kwargs'\[0\]\['relation'\] of 'length_constraints:number_words' is 'more than'; accepted: 'less than' or "
     r"'at least'"),
    (_row(("length_constraints:number_words", {"num_words": -1, "relation": AT_LEAST})), r"a whole number >= 0"),
    (_row(("length_constraints:number_words", {"num_words": True, "relation": AT_LEAST})), r"a whole number >= 0"),
    (_row(("length_constraints:number_words", {"num_words": "5", "relation": AT_LEAST})), r"a whole number >= 0"),
    (_row(("length_constraints:number_paragraphs", {"num_paragraphs": 0})), r"a whole number >= 1"),
    (_row(("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1, "let_relation": AT_LEAST})),
     r"\['letter'\] .* is 'ab'; accepted: one letter a-z"),
    (_row(("language:response_language", {"language": "english"})), r"accepted: a language code langdetect knows"),
    (_row(("keywords:existence", {"keywords": []})), r"accepted: a non-empty list of non-blank strings"),
    (_row(("startend:end_checker", {"end_phrase": "  "})), r"accepted: a non-blank string"),
])
def test_bad_rows_are_named_at_load_and_raise_when_scored(row, message):
    reward = InstructionsReward(InstructionsConfig())
    reason, why = reward.row_problem(row)
    assert reason == "bad_instructions"
    assert re.search(message, why), why
    with pytest.raises(InputError, match=message):
        reward("p", "response", [], row)
    assert reward.row_problem(_row(("punctuation:no_comma", {}))) is None


@pytest.mark.parametrize("task, message", [
    ({"kind": "math", "instructions": {}}, r"instructions is set but kind='math'"),
    ({"kind": "instructions", "pattern": "x"}, r"takes no pattern or required_phrases"),
    ({"kind": "instructions", "instructions": {"mode": "lenient"}},
     r"mode.*'lenient' is not allowed.*'strict', 'loose'"),
    ({"kind": "instructions", "instructions": {"aggregate": "mean"}}, r"aggregate.*'mean' is not allowed"),
    ({"kind": "instructions", "instructions": {"kwargs_field": "instruction_id_list"}}, r"are both"),
    ({"kind": "instructions", "instructions": {"ids_field": " "}}, r"instructions.ids_field is blank"),
])
def test_config_errors_name_the_key(task, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(RewardConfig, {"default_task": "t", "tasks": {"t": task}})


class _Characters:
    """A tokenizer of one token per character: the loader's prompt check needs no more (a real one
    takes seconds to load)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


def test_yaml_config_loads_rows_and_scores_through_the_sandboxed_router(tmp_path, caplog):
    from jaxrl.data import load_examples
    from jaxrl.trainer.config import TrainConfig

    rows = [
        {"prompt": "say hi", "task": "if", "instruction_id_list": ["punctuation:no_comma", "startend:end_checker"],
         "kwargs": [{"end_phrase": None}, {"end_phrase": "bye"}]},
        {"prompt": "say hi", "task": "if", "instruction_id_list": ["keywords:nope"], "kwargs": [{}]},
        {"prompt": "add", "task": "math", "answer": "2"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "run.yaml").write_text(f"""\
output_dir: {tmp_path / "out"}
model: {{hf_path: {tmp_path / "model"}}}
data: {{tokenizer: {tmp_path / "tok"}, train_files: [{tmp_path / "train.jsonl"}], use_chat_template: false}}
reward:
  default_task: math
  tasks:
    math: {{kind: math}}
    if: {{kind: instructions, instructions: {{mode: loose, aggregate: fraction}}}}
""")
    config = load_config(TrainConfig, tmp_path / "run.yaml")
    assert config.reward.tasks["if"].instructions == InstructionsConfig(mode="loose")
    with build_router(config.reward) as router, caplog.at_level(logging.WARNING):
        examples, report = load_examples(config.data.train_files, config.data, _Characters(),
                                         row_check=router.row_problem)
        assert report.bad_by_reason == {"bad_instructions": 1} and "'keywords:nope'" in caplog.text
        assert [e.row["task"] for e in examples] == ["if", "math"]
        responses = ["Hi, bye", r"\boxed{2}"]
        scored = router.score([e.prompt for e in examples], responses, [[], []], [e.row for e in examples])
        assert router.worker_pid is not None  # scored in the reward worker, as in training
    np.testing.assert_allclose(scored.scores, [0.5, 1.0])
    assert scored.tasks == ("if", "math") and not scored.raised.any()
