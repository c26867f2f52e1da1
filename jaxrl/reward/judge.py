"""Generative verifier rewards (DeepSeekMath-V2, DeepSeek 2025, section 2): what a judgement is.

A judge model grades text with a rubric and ends its reply with a score in ``\\boxed{}``: 1 for
a complete, rigorous proof, 0.5 for a sound proof with minor errors or omissions, 0 for a
fundamentally flawed one. A second rubric (meta-verification) grades a proof *analysis*: whether
the issues it names exist and justify its score. This module holds the config of a judge task
(``reward.tasks.<name>.judge``), the rubric templates, the score parser, the paper's reward
formulas and, per reward kind, which judgements a sample needs and how they combine
(``JUDGE_KINDS``). Scoring a batch (concurrent calls, retries, the cache, metrics) is
``jaxrl.reward.judge_batch``; docs/training.md#generative-verifier-rewards.

The kinds, named by the policy being trained (s: the judge's score of a proof; s': the score the
policy itself wrote; R_meta: the judge's meta-verification score of the policy's analysis):

- ``judge``, a proof generator: R = R_format * s (the paper's R_Y, eq. 4);
- ``verifier``, a proof verifier whose response analyses the row's proof and scores it s',
  against the row's reference score s: R = R_format * (1 - |s' - s|) * R_meta (eqs. 1 and 3);
- ``self_verification``, a generator that writes a proof Y and then a self-analysis Z scoring it
  s': R = R_format * (alpha * R_Y + beta * R_Z), R_Y = s (the judge's score of Y),
  R_Z = (1 - |s' - s|) * R_meta(Z) (eqs. 5 and 6; alpha = 0.76, beta = 0.24 in the paper).

R_format is 1 when the response has the task's format (``pattern`` and ``required_phrases`` of
its ``reward.tasks`` entry, and for the last two kinds a parsable s'), else 0: a policy that
breaks the format earns 0, as in the paper, and no judge is asked. A judgement the judge could
not give is another matter: the sample is masked, never guessed (``judge_batch``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Mapping

from jaxrl.reward.judge_vote import Combine
from jaxrl.reward.math import extract_boxed

# The rubrics, in our words after the paper's appendices A.2 (proof verification) and A.3
# (meta-verification). The inputs come last, so the text a judge reads last is the one it grades.
JUDGE_TEMPLATES: Mapping[str, str] = {
    "proof_verification": """\
Grade the solution to the problem below. The problem asks for a proof, or for an answer together with a \
rigorous proof that the answer is right.

Scores:
- 1: the solution is complete and correct, every step is justified and clearly presented.
- 0.5: the solution is sound overall but omits some details or has minor errors.
- 0: the solution does not solve the problem, has a fatal error, or leaves out something essential.
Citing a result from a paper does not excuse proving it: a solution that relies on a citation without \
a correct proof of it cannot score 1.

Reply in this form:
Here is my evaluation of the solution:
(the key steps, and the steps whose correctness you doubted: for each, why it is right, or what is \
wrong and what that breaks)
Based on my evaluation, the final overall score should be:
\\boxed{...} (0, 0.5 or 1, nothing else)

## Problem
{problem}

## Solution
{proof}""",
    "meta_verification": """\
Below are a problem, a solution, and an evaluation of that solution written by a grader who scored it \
1 (complete and rigorous), 0.5 (sound, minor errors or omissions) or 0 (fundamentally flawed). Judge \
the evaluation, not the problem.

Check the evaluation for:
- restatements: does the solution really contain the steps the evaluation attributes to it?
- flaws: does each issue the evaluation reports exist, and is it analysed correctly? Only the \
reported issues matter; what the evaluation accepts as correct is outside your task.
- expression: misquotations, calculation slips, or calling a conclusion wrong when it only rests on \
an unproven step.
- score: does the score follow from the issues found, by the scale above?

Scores:
- 0: every issue the evaluation reports is unfounded.
- 0.5: some reported issues are real and some unfounded; or all are real (or none is reported) but \
the evaluation has an expression error or a score that does not follow.
- 1: the reported issues (if any) are real, well analysed, and the score follows.

Reply in this form:
Here is my analysis of the solution evaluation:
(your analysis)
Based on my analysis, I rate the solution evaluation as:
\\boxed{...} (0, 0.5 or 1, nothing else)

## Problem
{problem}

## Solution
{proof}

## Solution evaluation
{analysis}""",
}

# What each template slot is filled with (render): the problem, the proof graded, the analysis graded.
_SLOTS = ("problem", "proof", "analysis")
_SLOT = re.compile(r"\{(" + "|".join(_SLOTS) + r")\}")
# A score the rubric allows, as written in a box: 0, 0.5 or 1 (0.0, 1.0, .5, 0.50 too).
_SCORE = re.compile(r"(0|1)(?:\.0*)?|(0?\.50*)")


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """``reward.tasks.<name>.judge``: how a task of a judge kind (``JUDGE_KINDS``) asks its judge.

    server: the judge, a key of the run's top-level ``judges`` section (an SGLang fleet).
    template: the rubric for grading a proof (slots ``{problem}``, ``{proof}``); meta_template:
    the rubric for grading an analysis (``{problem}``, ``{proof}``, ``{analysis}``). Each is a
    name in ``JUDGE_TEMPLATES`` or the path of a text file; a slot is replaced by its text, every
    other character is kept as written. problem_field: the row field with the problem (None: the
    prompt the policy was given). proof_field, score_field: (``verifier``) the row fields with
    the proof under analysis and its reference score (0, 0.5 or 1). analysis_header:
    (``self_verification``) the text that starts the self-analysis Z; the proof Y is what comes
    before it. retries: how many more times a judgement that failed or could not be parsed is
    asked before its sample is masked. alpha, beta: the ``self_verification`` weights.
    samples: how many times each judgement (each pass of the kind) is drawn, each draw with its own
    sampling seed; combine: how the draws' scores become the judgement's, ``majority``, ``mean`` or
    ``min`` (``jaxrl.reward.judge_vote``; DeepSeekMath-V2's scaled verification). More than one
    draw needs a judge that samples (``judges.<server>.temperature`` > 0).
    """

    server: str
    template: str = "proof_verification"
    meta_template: str = "meta_verification"
    problem_field: str | None = None
    proof_field: str = "proof"
    score_field: str = "score"
    analysis_header: str = "## Self Evaluation"
    retries: int = 2
    alpha: float = 0.76
    beta: float = 0.24
    samples: int = 1
    combine: Combine = "majority"

    def __post_init__(self):
        if not self.server:
            raise ValueError("judge.server is empty; name the judge fleet, a key of the top-level judges section")
        if self.retries < 0:
            raise ValueError(f"judge.retries={self.retries} must be >= 0 (0: each judgement is asked once)")
        for key in ("alpha", "beta"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"judge.{key}={getattr(self, key)} must be >= 0")
        if self.samples < 1:
            raise ValueError(f"judge.samples={self.samples} must be >= 1 (1: each judgement is drawn once)")
        if not self.analysis_header.strip():
            raise ValueError("judge.analysis_header is blank; give the text that starts the self-analysis")

    def check_templates(self, kind: str) -> None:
        """ValueError naming the key unless each template ``kind`` uses can be read and has its slots."""
        for key in JUDGE_KINDS[kind].templates:
            needed = {"template": "{proof}", "meta_template": "{analysis}"}[key]
            if needed not in load_template(getattr(self, key), f"judge.{key}"):
                raise ValueError(f"judge.{key}={getattr(self, key)!r} has no {needed} slot; the judge would never "
                                 f"see the text it grades")


def load_template(spec: str, key: str, builtins: Mapping[str, str] = JUDGE_TEMPLATES) -> str:
    """The text of template ``spec``: a name in ``builtins`` or a file; ValueError naming ``key``."""
    if spec in builtins:
        return builtins[spec]
    if not os.path.isfile(spec):
        raise ValueError(f"{key}={spec!r} is neither a built-in template {sorted(builtins)} nor a file")
    with open(spec, encoding="utf-8") as f:
        return f.read()


def render(template: str, **slots: str) -> str:
    """``template`` with each ``{problem}``, ``{proof}``, ``{analysis}`` replaced by its text, in one
    pass, so braces in the texts (LaTeX) and in the rubric are left alone."""
    return _SLOT.sub(lambda m: slots.get(m.group(1), m.group(0)), template)


def parse_judge_score(text: str) -> float | None:
    """The score in the last ``\\boxed{}`` of ``text``: 0, 0.5 or 1; None for anything else (no box, an
    empty box, another number, words), which the caller treats as unparsable, never as a guess."""
    content = extract_boxed(text)
    match = _SCORE.fullmatch(content) if content is not None else None
    if match is None:
        return None
    return 0.5 if match.group(2) else float(match.group(1))


# ------------------------------------------------------------------------------- the formulas
def score_reward(predicted: float, reference: float) -> float:
    """R_score(s', s) = 1 - |s' - s| (DeepSeekMath-V2 eq. 1): how close a predicted proof score is."""
    return 1.0 - abs(predicted - reference)


def verifier_reward(format_ok: bool, predicted: float, reference: float, meta: float) -> float:
    """R = R_format * R_score(s', s) * R_meta (eq. 3): the reward of a verifier's analysis that scored
    the proof ``predicted`` (s'), against the ``reference`` score s, whose analysis the meta-verifier
    scored ``meta``."""
    return float(format_ok) * score_reward(predicted, reference) * meta


def self_verification_reward(format_ok: bool, proof_score: float, self_score: float, meta: float,
                             alpha: float, beta: float) -> float:
    """R = R_format * (alpha * R_Y + beta * R_Z), R_Y = s, R_Z = R_score(s', s) * R_meta (eqs. 5, 6): a
    generator's proof scored ``proof_score`` (s) by the judge, its self-analysis scored it
    ``self_score`` (s'), and the judge's meta-verification scored that self-analysis ``meta``."""
    return float(format_ok) * (alpha * proof_score + beta * score_reward(self_score, proof_score) * meta)


# ------------------------------------------------------------------------------- the kinds
@dataclasses.dataclass(frozen=True)
class Plan:
    """What one sample needs from the judge: ``prompts``, judge prompt by pass ("verify": grade a
    proof; "meta": grade an analysis), none when the reward is known without the judge (a broken
    format); ``reward`` maps the passes' scores to the sample's reward."""

    prompts: Mapping[str, str]
    reward: Callable[[Mapping[str, float]], float]


def _no_judgement(passes: Mapping[str, float]) -> float:
    return 0.0


NO_JUDGEMENT = Plan({}, _no_judgement)


@dataclasses.dataclass(frozen=True)
class JudgeInput:
    """One response to judge: the ``problem`` text, the policy's ``response``, its dataset ``row``,
    and whether the response passes the task's ``pattern``/``required_phrases`` (``format_ok``)."""

    problem: str
    response: str
    row: Mapping
    format_ok: bool


def _plan_judge(config: JudgeConfig, templates: Mapping[str, str], sample: JudgeInput) -> Plan:
    if not sample.format_ok:
        return NO_JUDGEMENT
    prompt = render(templates["template"], problem=sample.problem, proof=sample.response)
    return Plan({"verify": prompt}, lambda passes: passes["verify"])


def _plan_verifier(config: JudgeConfig, templates: Mapping[str, str], sample: JudgeInput) -> Plan:
    predicted, reference = parse_judge_score(sample.response), float(sample.row[config.score_field])
    # A zero R_format or R_score makes the product 0 whatever R_meta is: no judge call.
    if not sample.format_ok or predicted is None or score_reward(predicted, reference) == 0.0:
        return NO_JUDGEMENT
    prompt = render(templates["meta_template"], problem=sample.problem, proof=str(sample.row[config.proof_field]),
                    analysis=sample.response)
    return Plan({"meta": prompt}, lambda passes: verifier_reward(True, predicted, reference, passes["meta"]))


def _plan_self_verification(config: JudgeConfig, templates: Mapping[str, str], sample: JudgeInput) -> Plan:
    proof, header, analysis = sample.response.partition(config.analysis_header)
    proof, self_score = proof.strip(), parse_judge_score(analysis)
    if not (sample.format_ok and header and proof) or self_score is None:
        return NO_JUDGEMENT
    prompts = {"verify": render(templates["template"], problem=sample.problem, proof=proof),
               "meta": render(templates["meta_template"], problem=sample.problem, proof=proof,
                              analysis=analysis.strip())}
    return Plan(prompts, lambda passes: self_verification_reward(True, passes["verify"], self_score, passes["meta"],
                                                                 config.alpha, config.beta))


@dataclasses.dataclass(frozen=True)
class JudgeKind:
    """A reward kind scored by a judge: the ``JudgeConfig`` templates it uses, ``plan(config,
    templates, sample)``, and whether its rows hold a proof and its reference score
    (``JudgeConfig.proof_field``, ``score_field``) besides the problem."""

    templates: tuple[str, ...]
    plan: Callable[[JudgeConfig, Mapping[str, str], JudgeInput], Plan]
    graded_proof_in_row: bool = False


JUDGE_KINDS: Mapping[str, JudgeKind] = {
    "judge": JudgeKind(("template",), _plan_judge),
    "verifier": JudgeKind(("meta_template",), _plan_verifier, graded_proof_in_row=True),
    "self_verification": JudgeKind(("template", "meta_template"), _plan_self_verification),
}


def reference_score_problem(value) -> str | None:
    """Why ``value`` cannot be a reference score (0, 0.5 or 1), or None when it can."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return f"is {type(value).__name__}"
    try:
        number = float(value)
    except ValueError:
        return f"is {value!r}"
    return None if number in (0.0, 0.5, 1.0) else f"is {value!r}"
