"""A judge model on SGLang servers: the ``judges.<name>`` config section and ``SGLangJudge``, the
``jaxrl.reward.judge_batch.JudgeModel`` a reward router asks (docs/training.md#generative-verifier-rewards).

The fleet is one jaxrl starts (``server``: a ``ServerManager``, which restarts a server that
died) or one started elsewhere (``urls``: ``ExternalServers``, which checks at start that every
URL answers and names the one that does not). Requests go through ``SGLangClient``, with its
thread pool (``client.max_concurrency`` in flight) and its retries of failed HTTP calls: each
judge prompt is tokenised with the judge's tokenizer (as a user turn of its chat template when it
has one), sent as token ids to server ``i mod N``, and the reply decoded.
"""

from __future__ import annotations

import dataclasses

from jaxrl.data import encode_prompt, load_tokenizer
from jaxrl.reward.judge_batch import JudgeReply
from jaxrl.rollout.base import SamplingParams, check_sampling_ranges
from jaxrl.rollout.sglang.client import ClientConfig, SGLangClient, Settled, sampling_payload
from jaxrl.rollout.sglang.external import ExternalServers
from jaxrl.rollout.sglang.launch import ServerConfig
from jaxrl.rollout.sglang.server import ServerManager


@dataclasses.dataclass(frozen=True)
class JudgeServerConfig:
    """``judges.<name>``: the SGLang fleet that serves a judge model.

    tokenizer: the judge's tokenizer folder (the servers get token ids). Exactly one of
    ``server`` (a fleet jaxrl starts and stops; give it a ``base_port`` apart from the rollout
    fleet's) and ``urls`` (servers started elsewhere; their API key, if any, from
    ``JAXRL_SGLANG_API_KEY``). temperature [0: greedy], top_p, top_k, max_new_tokens: the judge's
    sampling; at temperature 0 a judge repeats an unparsable reply, so ``judge.retries`` then
    helps only with failed requests. use_chat_template: send each prompt as a user turn of the
    tokenizer's chat template, when it has one. client: the HTTP client (tries per request,
    timeout, requests in flight).
    """

    tokenizer: str
    server: ServerConfig | None = None
    urls: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 2048
    use_chat_template: bool = True
    client: ClientConfig = ClientConfig()

    def __post_init__(self):
        if not self.tokenizer:
            raise ValueError("tokenizer is empty; give the judge's tokenizer folder")
        if (self.server is None) == (not self.urls):
            raise ValueError("give exactly one of server (a fleet jaxrl starts) and urls (servers started "
                             f"elsewhere); got {'both' if self.server is not None else 'neither'}")
        check_sampling_ranges("judge", self)


class SGLangJudge:
    """A ``JudgeModel`` on the fleet ``config`` names, started (``server``) or checked (``urls``) here.

    identity: the weights (the managed fleet's ``model_path``, or the external URLs), the version
    the servers report, the sampling and the tokenizer: what a cached judgement depends on
    besides its prompt. ``close()`` stops a fleet it started.
    """

    def __init__(self, config: JudgeServerConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.manager = ServerManager(config.server).start() if config.server is not None else None
        self.fleet = self.manager if self.manager is not None else ExternalServers(config.urls, model_path="")
        self.client = SGLangClient(self.fleet.urls, config.client, on_failure=self.fleet.ensure_running,
                                   describe=self.fleet.describe, api_key=self.fleet.api_key)
        params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                max_new_tokens=config.max_new_tokens, stop_token_ids=(self.tokenizer.eos_token_id,))
        self.sampling = sampling_payload(params, 1)
        weights = config.server.model_path if config.server is not None else " ".join(self.fleet.urls)
        self.identity = (f"{weights} version {self.fleet.weight_version}; sampling {sorted(self.sampling.items())}; "
                         f"tokenizer {config.tokenizer}, chat template {config.use_chat_template}")

    def describe(self) -> str:
        return "; ".join(self.fleet.describe(i) for i in range(self.fleet.num_servers))

    def judge(self, prompts, seeds=None) -> list[JudgeReply]:
        """One reply per prompt, all requests in flight at once, prompt ``i`` with SGLang's
        ``sampling_seed`` ``seeds[i]`` when given (honoured by servers started with
        ``--enable-deterministic-inference``); a request that failed for good is a reply with its
        error (naming the server's URL)."""
        calls = []
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(self.tokenizer, prompt, use_chat_template=self.config.use_chat_template)
            sampling = self.sampling if seeds is None else {**self.sampling, "sampling_seed": int(seeds[i])}
            payload = {"input_ids": ids, "sampling_params": sampling}
            calls.append((i % self.fleet.num_servers, "POST", "/generate", payload, f"judgement ({len(ids)} tokens)"))
        settled = self.client.map_settled(calls)
        return [self._reply(outcome, call[0]) for outcome, call in zip(settled, calls, strict=True)]

    def _reply(self, outcome: Settled, server: int) -> JudgeReply:
        if outcome.error is not None:
            return JudgeReply(None, str(outcome.error), outcome.seconds)
        response = outcome.result if isinstance(outcome.result, dict) else {}
        finish = ((response.get("meta_info") or {}).get("finish_reason") or {}).get("type")
        if "output_ids" not in response or finish not in ("stop", "length"):
            return JudgeReply(None, f"{self.fleet.describe(server)}: the judgement came back without output "
                                    f"(finish_reason {finish!r}); the server's log says why", outcome.seconds)
        return JudgeReply(self.tokenizer.decode(response["output_ids"], skip_special_tokens=True), "", outcome.seconds)

    def close(self) -> None:
        """Stops the client and a fleet started here; idempotent."""
        self.client.close()
        if self.manager is not None:
            self.manager.stop()
