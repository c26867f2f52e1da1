"""The ``kind: python`` reward functions of the trainer tests, referenced as ``toy_rewards:<name>``.

Their own light module: the reward worker imports the module a function lives in, and a test
module (jax, flax, the trainer, pytest) took it about 3 s to import, at every trainer's start.
"""

from jaxrl.reward import RewardResult

DIGIT_IDS = range(3, 13)  # make_char_tokenizer: <pad>, <eos>, <unk>, then the demo alphabet "0123456789+="


def digit_reward(prompt, response, response_ids, row):
    """A dense reward a random model already gets some of: the fraction of digits in the response."""
    return RewardResult(score=sum(c.isdigit() for c in response) / max(len(response), 1))


def exploding_reward(prompt, response, response_ids, row):
    """Raises on odd-length responses (a reward function's bug), scores the rest 0 or 1."""
    if len(response) % 2:
        raise RuntimeError("reward bug")
    return RewardResult(score=float(len(response) % 4 == 0))


def parity_reward(prompt, response, response_ids, row):
    """Even answers: 0.5 whatever the response (a group with no signal); odd: the fraction of
    digits in the response (varies between samples, mostly)."""
    if int(row["answer"]) % 2 == 0:
        return RewardResult(score=0.5)
    return RewardResult(score=sum(c.isdigit() for c in response) / max(len(response), 1))


def digit_token_reward(prompt, response, response_ids, row):
    """Per-token rewards: 1 for each digit token, on the token itself; the score is their sum."""
    per_token = [1.0 if t in DIGIT_IDS else 0.0 for t in response_ids]
    return RewardResult(score=sum(per_token), token_rewards=per_token)


def short_token_reward(prompt, response, response_ids, row):
    """A reward function bug: one token reward short."""
    return RewardResult(score=0.0, token_rewards=[0.0] * (len(response_ids) - 1))


def python_reward(function: str) -> dict:
    """The ``reward`` section of a run scored by ``function`` (a name in this module), for every row."""
    return {"default_task": "t", "task_field": "none",
            "tasks": {"t": {"kind": "python", "function": f"{__name__}:{function}"}}}
