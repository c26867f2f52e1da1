"""HTTP client for SGLang's native API: token-in/token-out ``/generate``, with retries.

Runs in the trainer's environment (``requests`` + threads); never imports SGLang.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import requests

from jaxrl.rollout.base import LogprobKind, Sample, SamplingParams
from jaxrl.rollout.sglang.access import auth_headers


class SGLangRequestError(RuntimeError):
    """A request failed for good; the message names the server, the request and what to check."""


class SGLangResponseError(ValueError):
    """A server answered, but not with what was asked for (missing logprobs, wrong shapes, ...)."""


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """max_tries: attempts per request (>= 1); backoff_s: wait ``backoff_s * 2**k`` after failed try k;
    timeout_s: per HTTP request; max_concurrency: requests in flight over all servers."""

    max_tries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    max_concurrency: int = 64

    def __post_init__(self):
        for field, value, ok, expected in (
            ("max_tries", self.max_tries, self.max_tries >= 1, ">= 1"),
            ("backoff_s", self.backoff_s, self.backoff_s >= 0, ">= 0 seconds"),
            ("timeout_s", self.timeout_s, self.timeout_s > 0, "> 0 seconds"),
            ("max_concurrency", self.max_concurrency, self.max_concurrency >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"ClientConfig.{field}: got {value!r}, expected {expected}")


class _RetryableError(Exception):
    pass


class SGLangClient:
    """Sends requests to a fleet of SGLang servers, spreading them data-parallel.

    urls: one base URL per server.
    on_failure: called with a server index after a failed try, before the next
      one (the server manager's ``ensure_running``: restarts a dead server).
    describe: names a server for errors (default: its URL).
    api_key: sent with every request as ``Authorization: Bearer KEY`` (SGLang ``--api-key``);
      "" sends none. Never part of an error message.
    """

    def __init__(
        self,
        urls: Sequence[str],
        config: ClientConfig = ClientConfig(),
        on_failure: Callable[[int], Any] | None = None,
        describe: Callable[[int], str] | None = None,
        api_key: str = "",
    ):
        if not urls:
            raise ValueError("SGLangClient: urls is empty; expected at least one server URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.config = config
        self._headers = auth_headers(api_key)
        self._on_failure = on_failure
        self._describe = describe or (lambda i: f"SGLang server {i} at {self.urls[i]}")
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.max_concurrency, thread_name_prefix="sglang-client")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self._headers)
        return self._local.session

    def request(self, server: int, method: str, route: str, payload: dict | None, name: str) -> Any:
        """One HTTP call with retries; returns the decoded JSON.

        Retried: connection errors, timeouts, HTTP 5xx. Not retried: HTTP 4xx
        (the request itself is wrong; retrying cannot help).
        """
        url = self.urls[server] + route
        last_error = None
        for attempt in range(self.config.max_tries):
            try:
                return self._call(method, url, payload)
            except _RetryableError as err:
                last_error = err
            except requests.HTTPError as err:
                if err.response is not None and err.response.status_code in (401, 403):
                    raise SGLangRequestError(
                        f"{self._describe(server)} refused {name} ({method} {route}): HTTP "
                        f"{err.response.status_code} {_body(err.response)}; the server requires an API key "
                        + ("and this client sent none: give the key the servers were started with "
                           "(ServerConfig.api_key, or JAXRL_SGLANG_API_KEY for servers started outside jaxrl)"
                           if not self._headers else
                           "and the one sent is not it: check ServerConfig.api_key / JAXRL_SGLANG_API_KEY "
                           "against the servers' --api-key (an --admin-api-key also guards admin routes "
                           "such as /update_weights_from_disk)")) from None
                raise SGLangRequestError(
                    f"{self._describe(server)} rejected {name} ({method} {route}): {err}; "
                    f"server said: {_body(err.response)}. Check the request fields against the "
                    "SGLang version in use (scripts/sglang_cpu/requirements-cpu.lock)") from None
            if attempt + 1 < self.config.max_tries:
                if self._on_failure is not None:
                    self._on_failure(server)
                time.sleep(self.config.backoff_s * 2**attempt)
        raise SGLangRequestError(
            f"{self._describe(server)}: {name} ({method} {route}) failed after "
            f"{self.config.max_tries} tries (ClientConfig.max_tries); last error: {last_error}. "
            "Check that the server is running and reachable (its log says why it stopped), and "
            "that the host/port in ServerConfig are right")

    def _call(self, method: str, url: str, payload: dict | None) -> Any:
        try:
            response = self._session().request(method, url, json=payload, timeout=self.config.timeout_s)
        except (requests.ConnectionError, requests.Timeout) as err:
            raise _RetryableError(f"{type(err).__name__}: {err}") from None
        if response.status_code >= 500:
            raise _RetryableError(f"HTTP {response.status_code}: {_body(response)}")
        response.raise_for_status()
        try:
            return response.json()
        except ValueError:  # a few admin routes (/flush_cache) answer plain text
            return response.text

    def score(self, server: int, token_ids: list[int]) -> np.ndarray:
        """SGLang's raw logprobs of a given sequence (teacher forcing): [L - 1] float32,
        entry t = log p(token_{t+1} | tokens_{<=t}). ``input_token_logprobs`` are raw
        (temperature 1, unfiltered) whatever the fleet's logprob_kind."""
        return self.scored_logprobs(server, token_ids, self.score_request(server, token_ids))

    def score_request(self, server: int, token_ids: list[int]) -> dict:
        """The ``meta_info`` of the server's answer to scoring ``token_ids``: the logprobs
        (:meth:`scored_logprobs` reads them) and the ``weight_version`` that scored them, so a push
        is verified in one request per server."""
        payload = {"input_ids": token_ids, "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        response = self.request(server, "POST", "/generate", payload, f"scoring request ({len(token_ids)} tokens)")
        return response.get("meta_info") or {}

    def scored_logprobs(self, server: int, token_ids: list[int], meta: dict) -> np.ndarray:
        """The [L - 1] logprobs of :meth:`score` from :meth:`score_request`'s ``meta``."""
        entries = meta.get("input_token_logprobs")
        if entries is None or len(entries) != len(token_ids):
            raise SGLangResponseError(
                f"{self._describe(server)}, scoring request ({len(token_ids)} tokens): expected {len(token_ids)} "
                f"input_token_logprobs, got {None if entries is None else len(entries)}; check that "
                "the server honours logprob_start_len (SGLang >= 0.5.23)")
        return np.asarray([e[0] for e in entries[1:]], np.float32)

    def map(self, calls: Sequence[tuple[int, str, str, dict | None, str]]) -> list[Any]:
        """Runs many ``request`` calls concurrently; results in the order given.

        The first failure cancels calls not yet started and is raised.
        """
        futures = [self._pool.submit(self.request, *call) for call in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def map_settled(self, calls: Sequence[tuple[int, str, str, dict | None, str]]) -> list[Settled]:
        """Runs many ``request`` calls concurrently, each to its end; one ``Settled`` per call, in order.

        For callers that handle failures call by call (a judge retries a failed judgement, then
        masks it): a call that fails for good is its ``error``, and the others still finish.
        """
        def timed(call) -> Settled:
            start = time.perf_counter()
            try:
                return Settled(self.request(*call), None, time.perf_counter() - start)
            except (SGLangRequestError, requests.RequestException) as err:
                return Settled(None, err, time.perf_counter() - start)

        return [f.result() for f in [self._pool.submit(timed, call) for call in calls]]


class Settled(NamedTuple):
    """How one request of ``SGLangClient.map_settled`` ended: its decoded JSON ``result``, or None and
    the ``error``; ``seconds`` from its start to its end, retries included."""

    result: Any
    error: Exception | None
    seconds: float


def sampling_payload(params: SamplingParams, n: int) -> dict:
    """SGLang ``sampling_params`` for ours. Generation stops on ``params.stop_token_ids`` or the
    length limit, as the embedded sampler does. SGLang honours ``stop_token_ids`` only without
    ``ignore_eos`` (with it, nothing but the length stops a request), and then also stops on the
    model's own end-of-sequence ids (its config's ``eos_token_id``, its tokenizer's): give those in
    ``stop_token_ids`` too, so that both engines stop at the same tokens."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": False,
        "n": n,
    }


def generate_payload(prompt_ids: Sequence[int], params: SamplingParams, n: int,
                     return_routed_experts: bool) -> dict:
    """A ``/generate`` body for ``n`` samples of one prompt.

    RAW logprobs come in ``output_token_logprobs`` (the fleet must run with
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``); PROCESSED ones are asked for with
    ``return_sampling_mask`` and come in ``output_token_sampling_logprobs``.
    """
    payload = {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling_payload(params, n),
        "return_logprob": True,
    }
    if params.logprob_kind == LogprobKind.PROCESSED:
        payload["return_sampling_mask"] = True
        payload["sampling_logprobs_mode"] = "selected"
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def parse_samples(response: Any, prompt_ids: Sequence[int], params: SamplingParams, n: int,
                  moe_top_k: int | None, where: str) -> list[Sample]:
    """Turns a ``/generate`` response (one dict, or a list of ``n``) into ``n`` Samples.

    where: names the server and request for errors.
    """
    outputs = response if isinstance(response, list) else [response]
    if len(outputs) != n:
        raise SGLangResponseError(f"{where}: asked for n={n} samples, got {len(outputs)} outputs")
    return [_parse_one(o, prompt_ids, params, moe_top_k, f"{where}, sample {j}")
            for j, o in enumerate(outputs)]


def _parse_one(output: dict, prompt_ids, params: SamplingParams, moe_top_k, where: str) -> Sample:
    meta = output.get("meta_info") or {}
    output_ids = np.asarray(output.get("output_ids", []), np.int32)
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in ("stop", "length"):
        raise SGLangResponseError(
            f"{where}: finish_reason {meta.get('finish_reason')!r} (expected stop or length); "
            "the server aborted the request: check its log (out of KV cache? prompt too long?)")
    if params.logprob_kind == LogprobKind.RAW:
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(output_ids):
            raise SGLangResponseError(
                f"{where}: response has {'no' if entries is None else len(entries)} "
                f"output_token_logprobs for {len(output_ids)} output tokens; check that the "
                "server is SGLang >= 0.5.23 and honours return_logprob")
        logprob_ids = np.asarray([e[1] for e in entries], np.int32)
        if not np.array_equal(logprob_ids, output_ids):
            raise SGLangResponseError(f"{where}: output_token_logprobs token ids {logprob_ids.tolist()} "
                                      f"differ from output_ids {output_ids.tolist()}")
        logprobs = np.asarray([e[0] for e in entries], np.float32)
    else:
        values = meta.get("output_token_sampling_logprobs")
        if values is None or len(values) != len(output_ids):
            raise SGLangResponseError(
                f"{where}: response has {'no' if values is None else len(values)} "
                f"output_token_sampling_logprobs for {len(output_ids)} output tokens; PROCESSED "
                "logprobs need return_sampling_mask support (SGLang >= 0.5.23)")
        logprobs = np.asarray(values, np.float32)
    routes = prompt_routes = None
    if moe_top_k is not None:
        encoded = meta.get("routed_experts")
        if encoded is None:
            raise SGLangResponseError(
                f"{where}: no meta_info.routed_experts; start the servers with "
                "ServerConfig.return_routed_experts=True")
        # SGLang reports every fed position, 0 .. P+N-2: the first P-1 are the prompt's, the
        # other N produced the output tokens (the split of ``Sample``, as the embedded sampler's).
        fed = decode_routed_experts(encoded, len(prompt_ids) + len(output_ids) - 1, moe_top_k)
        prompt_routes, routes = fed[:len(prompt_ids) - 1], fed[len(prompt_ids) - 1:]
    return Sample(
        prompt_ids=np.asarray(prompt_ids, np.int32),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=finish,
        weight_version=str(meta.get("weight_version")),
        logprob_kind=params.logprob_kind,
        routed_experts=routes,
        prompt_routed_experts=prompt_routes,
    )


def decode_routed_experts(encoded: str, num_positions: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` -> int32 [num_positions, num_layers, top_k].

    encoded: base64 of little-endian int32, row-major [positions, layers, top_k];
    num_positions: tokens fed to the model, ``len(prompt) + len(output) - 1``.
    """
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    per_position = num_positions * top_k
    if num_positions <= 0 or flat.size % per_position:
        raise SGLangResponseError(
            f"routed_experts holds {flat.size} int32 values, not a multiple of "
            f"{num_positions} positions x top_k {top_k}; check num_experts_per_tok in the model config")
    return flat.reshape(num_positions, flat.size // per_position, top_k).astype(np.int32)


def _body(response: requests.Response | None, limit: int = 500) -> str:
    if response is None:
        return "(no response)"
    return response.text[:limit]
