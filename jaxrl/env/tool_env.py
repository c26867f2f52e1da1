"""The built-in tool-calling environment and how tool results become tokens (docs/agentic.md#observations).

``ToolEnvironment``: the prompt is the row's text (through the chat template, with the tools'
schemas, when the tokenizer has one); each model turn is parsed for tool calls
(``jaxrl.env.tools``); a turn without one ends the conversation (answered); otherwise every call
runs and the results come back as one observation.

Observation tokens. With a chat template, each result is a ``{"role": "tool"}`` message
rendered by the template, and only the new text is encoded: the template renders a fixed
two-message context with and without the tool messages (plus the generation prompt), and the
observation is the difference, starting right after the end-of-turn token the model itself
generated (so the template's separator after it, e.g. Qwen's newline after ``<|im_end|>``, is
part of the observation). Earlier turns are never rendered or re-tokenised again. Without a
chat template (the demo tokenizer has none) each result is encoded as the text
``<tool_response>\\n...\\n</tool_response>\\n``, the Hermes wrapping, directly.
An observation longer than ``limits.max_observation_tokens`` has its tool text cut (by tokens)
and ends with a visible ``[... truncated N tokens]`` marker, counted in ``truncations``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxrl.data.tokenizer import encode_prompt
from jaxrl.env.base import ANSWERED, TURN_LENGTH, Environment, EnvLimits, StepResult, truncate_tokens
from jaxrl.env.tools import Tool, ToolResult, call_tool, parse_tool_calls, tool_schema
from jaxrl.rollout.base import Conversation

_CONTEXT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
RewardHook = Callable[[str, Mapping], "float | None"]


class ObservationEncoder:
    """Tool results -> observation token ids for one tokenizer (module doc)."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.template = bool(use_chat_template and getattr(tokenizer, "chat_template", None))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, contents: Sequence[str]) -> str:
        """The observation text for these tool results."""
        if not self.template:
            return "".join(f"\n<tool_response>\n{c}\n</tool_response>\n" for c in contents)
        messages = [{"role": "tool", "content": c} for c in contents]
        base = self.tokenizer.apply_chat_template(_CONTEXT, tokenize=False)
        full = self.tokenizer.apply_chat_template(_CONTEXT + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier messages differently once a tool message follows; "
                             "the observation cannot be appended as a suffix (set use_chat_template: false)")
        eos = self.tokenizer.eos_token or ""
        start = base.rindex(eos) + len(eos) if eos and eos in base else len(base)
        return full[start:]

    def encode(self, contents: Sequence[str], limit: int) -> tuple[list[int], int]:
        """(observation ids of at most ``limit`` tokens, how many results were cut). Each result's
        text gets an equal share of what the wrapping leaves; a cut ends with the marker."""
        ids = self._encode(self.render(contents))
        if len(ids) <= limit:
            return ids, 0
        overhead = len(self._encode(self.render([""] * len(contents))))
        share = max(0, (limit - overhead) // max(1, len(contents)))
        cut, kept = 0, []
        for content in contents:
            content_ids = self._encode(content)
            marker = self._encode(f"\n[... truncated {max(0, len(content_ids) - share)} tokens]")
            short, was_cut = truncate_tokens(content_ids, share, marker)
            cut += was_cut
            kept.append(self.tokenizer.decode(short) if was_cut else content)
        ids = self._encode(self.render(kept))
        # Decoding and re-encoding a cut text can merge tokens differently; the limit still holds.
        return ids[:limit], max(cut, 1)


class ToolEnvironment(Environment):
    """Tool calling over ``tools`` (name -> Tool), one conversation (module doc).

    prompt_field: the row field holding the prompt text. code_blocks: fenced ```python blocks
    also run (as the ``python`` tool). reward: optional hook ``reward(final_text, row)`` giving the
    reward when the model answers (None leaves it to the trainer's reward functions).
    """

    def __init__(self, tokenizer, tools: Mapping[str, Tool], limits: EnvLimits | None = None, *,
                 prompt_field: str = "prompt", use_chat_template: bool = True, system_prompt: str | None = None,
                 code_blocks: bool = False, reward: RewardHook | None = None):
        self.tokenizer, self.tools, self.limits = tokenizer, dict(tools), limits or EnvLimits()
        self.prompt_field, self.system_prompt, self.code_blocks = prompt_field, system_prompt, code_blocks
        self.reward_hook = reward
        self.observations = ObservationEncoder(tokenizer, use_chat_template)
        self.row: Mapping[str, Any] = {}

    def reset(self, row: Mapping) -> Conversation:
        if self.prompt_field not in row:
            raise ValueError(f"row has no {self.prompt_field!r} field (the prompt); fields: {sorted(map(str, row))}")
        self.row = row
        prompt = str(row[self.prompt_field])
        if self.observations.template and self.tools:
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(
                messages, tools=[tool_schema(t) for t in self.tools.values()], tokenize=False,
                add_generation_prompt=True)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = encode_prompt(self.tokenizer, prompt, use_chat_template=self.observations.template,
                                system_prompt=self.system_prompt)
        return Conversation.from_prompt(ids)

    def step(self, conversation: Conversation, model_turn: np.ndarray) -> StepResult:
        text = self.tokenizer.decode(list(model_turn), skip_special_tokens=True)
        calls = parse_tool_calls(text, code_blocks=self.code_blocks)
        if not calls:
            finish = TURN_LENGTH if conversation.finish_reasons[-1:] == ("length",) else ANSWERED
            reward = self.reward_hook(text, self.row) if self.reward_hook is not None and finish == ANSWERED else None
            return StepResult(reward=reward, done=True, info={"finish": finish})
        allowed = self.limits.max_tool_calls_per_turn
        results: list[ToolResult] = [call_tool(self.tools, call) for call in calls[:allowed]]
        skipped = len(calls) - len(results)
        texts = [r.text for r in results]
        if skipped:  # one answer for all of them: a turn of 40,000 calls must not render 40,000 results
            texts.append(f"Error: at most {allowed} tool calls per turn; the other {skipped} were not run")
        ids, truncations = self.observations.encode(texts, self.limits.max_observation_tokens)
        return StepResult(observation_ids=ids, info={
            "tool_calls": len(calls), "tool_errors": sum(r.error for r in results) + skipped,
            "tool_timeouts": sum(r.timed_out for r in results), "truncations": truncations})
