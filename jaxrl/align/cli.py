"""``jaxrl align``: the logprob-alignment checker on the command line.

  jaxrl align report DUMP.npz --out DIR [gate options]
      metrics, figures and gate for a batch dump saved by the trainer.
  jaxrl align run --model HF_DIR --prompts PROMPTS.jsonl --out DIR [--tokenizer DIR] [engine] [sampling] [gate]
      samples with an engine, recomputes with the learner (HF_DIR loaded into JAX), then as
      `report`. Engines: the embedded JAX sampler (default, --engine jax); SGLang servers
      already running (--engine sglang --server-url URL [--server-url URL ...]); or an SGLang
      server started for HF_DIR and stopped afterwards (--engine sglang --launch).
  jaxrl align localize --model HF_DIR --prompts PROMPTS.jsonl --out DIR --path PATH
      diffs activations module by module, layer by layer between two paths.

PROMPTS.jsonl holds one prompt per line: a list of token ids, {"prompt_ids": [...]}, or, with
--tokenizer DIR, text ("a string" or {"prompt": "..."}) that the tokenizer encodes (--chat-template:
as a user turn of its chat template); with --tokenizer, `run` also stops at its eos and the
model's own eos ids (jaxrl.data.stop_token_ids) besides any --stop-id.

Exit status: 0 when the gate passes (or none is set), 1 when it fails or a
module exceeds the localisation tolerance, 2 on bad input, with one line naming
the path and the problem: a missing, truncated or wrong-format dump, prompts file
or model folder, an --out that is a file, bad options, or an SGLang server that
cannot be reached or started.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from jaxrl.align.gate import GATEABLE, Gate
from jaxrl.errors import InputError, InputFileNotFoundError, one_line


def _add_gate_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gate (exit 1 when a limit is exceeded)")
    g.add_argument("--max-k3", type=float, help="limit on the k3 mismatch (vllm-kl)")
    g.add_argument("--max-abs-log-ratio", type=float, help="limit on max |learner logp - rollout logp|")
    g.add_argument("--max-frac-outside-band", type=float,
                   help="limit on the fraction of tokens whose ratio is outside --ratio-band")
    g.add_argument("--limit", action="append", default=[], metavar="METRIC=VALUE",
                   help=f"any other limit; METRIC one of {', '.join(GATEABLE)}")
    g.add_argument("--ratio-band", type=float, nargs=2, default=(0.5, 2.0), metavar=("LOW", "HIGH"),
                   help="ratio band for frac_outside_ratio_band (default 0.5 2)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")


def _gate_from_args(args) -> Gate | None:
    limits = {}
    for name, value in (("k3", args.max_k3), ("abs_log_ratio_max", args.max_abs_log_ratio),
                        ("frac_outside_ratio_band", args.max_frac_outside_band)):
        if value is not None:
            limits[name] = value
    for item in args.limit:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--limit {item!r} must look like METRIC=VALUE")
        try:
            limits[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--limit {item!r}: {value!r} is not a number") from None
    return Gate(limits) if limits else None


def _finish(batch, args) -> int:
    from jaxrl.align.report import write_report

    _, result, summary = write_report(batch, args.out, gate=_gate_from_args(args),
                                      ratio_band=tuple(args.ratio_band), figures=not args.no_figures)
    print(summary)
    print(f"written to {args.out}")
    return 0 if result is None or result.passed else 1


def _cmd_report(args) -> int:
    from jaxrl.align.dump import AlignmentBatch

    _check_out(args.out)
    batch = AlignmentBatch.load(args.dump)
    if batch.learner_logprobs is None:
        raise InputError(f"batch dump {args.dump!r} has no learner_logprobs, so there is nothing to compare; "
                         "dump batches after the learner's recompute (or score them with "
                         "jaxrl.align.check.score_with_learner)")
    if not batch.model_mask.any():
        raise InputError(f"batch dump {args.dump!r} has no model tokens ({batch.num_sequences} sequences); "
                         "there is nothing to compare")
    return _finish(batch, args)


def _check_out(path: str) -> None:
    """--out must be a folder, or a path where one can be made; checked before any work."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputError(f"--out {path!r} is an existing file, not a folder; give a folder (made if missing)")
        target = path
    else:
        target = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if not os.path.isdir(target):
            raise InputError(f"--out {path!r} cannot be made: {target!r} is a file, not a folder")
    if not os.access(target, os.W_OK):
        raise InputError(f"--out {path!r}: no permission to write in {target!r}")


def _check_save_dump(path: str | None) -> None:
    if not path:
        return
    if os.path.isdir(path):
        raise InputError(f"--save-dump {path!r} is a folder; give a file name ending in .npz")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"--save-dump {path!r}: folder {parent!r} does not exist")


def _read_prompts(path: str, tokenizer=None, chat_template: bool = False) -> list[list[int]]:
    """JSON lines, each a list of token ids or an object with "prompt_ids", or with ``tokenizer`` text (a
    string or an object with "prompt"), encoded; errors name the 1-based line."""
    if not os.path.isfile(path):
        problem = "is a folder" if os.path.isdir(path) else "does not exist"
        error = InputError if os.path.isdir(path) else InputFileNotFoundError
        raise error(f"--prompts {path!r} {problem}; expected a JSON-lines file of token-id lists")
    prompts = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"--prompts {path!r} cannot be read ({one_line(e.strerror or e)})") from e
    with f:
        for row, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path} line {row}: not valid UTF-8 at byte {e.start} of the line") from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InputError(f"{path} line {row}: not JSON ({one_line(e)})") from None
            ids = item.get("prompt_ids", item.get("prompt")) if isinstance(item, dict) else item
            if isinstance(ids, str):
                if tokenizer is None:
                    raise InputError(f"{path} line {row}: a text prompt needs --tokenizer DIR to encode it "
                                     f"(or give token ids)")
                from jaxrl.data import encode_prompt  # transformers: imported for text prompts only

                ids = encode_prompt(tokenizer, ids, use_chat_template=chat_template) if ids else []
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise InputError(f"{path} line {row}: expected a non-empty list of token ids (or "
                                 f"{{\"prompt_ids\": [...]}}; text with --tokenizer), got {line.strip()[:80]!r}")
            prompts.append(ids)
    if not prompts:
        raise InputError(f"{path} holds no prompts")
    return prompts


def _prompts(args):
    """The --prompts file's token ids, and the --tokenizer that encoded its text (None without one)."""
    tokenizer = None
    if args.tokenizer:
        from jaxrl.data import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    return _read_prompts(args.prompts, tokenizer, args.chat_template), tokenizer


def _check_model_folder(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        problem = "has no config.json" if os.path.isdir(path) else "does not exist"
        raise InputFileNotFoundError(f"--model {path!r} {problem}; expected a Hugging Face checkpoint "
                                     "folder (config.json + *.safetensors)")


def _load_model(args, mesh=None):
    from jaxrl.models.hf import load_hf_checkpoint

    _check_model_folder(args.model)
    overrides = {"dtype": args.dtype} if args.dtype else {}
    return load_hf_checkpoint(args.model, mesh=mesh, **overrides)


def _parse_mesh(text: str | None):
    if not text:
        return None
    from jaxrl.models.sharding import MeshConfig, make_mesh

    sizes = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE...], e.g. fsdp=2,tensor=2")
        sizes[name.strip()] = int(value)
    return make_mesh(MeshConfig.from_dict(sizes))


def _external_servers(urls: list[str], model_path: str):
    from jaxrl.rollout.sglang.external import ExternalServers

    try:
        return ExternalServers(urls, model_path)
    except ValueError as err:
        raise ValueError(f"--server-url {err}; or use --launch") from None


def _free_port(first: int = 30000, last: int = 32000) -> int:
    """A free port below the usual ephemeral range (32768-60999): the server binds it tens of
    seconds after this check, and an outgoing connection could take an ephemeral one meanwhile."""
    for port in range(first, last):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise ValueError(f"--launch: no free port in [{first}, {last}); give one with --server-port")


def _launched_servers(args):
    from jaxrl.rollout.sglang import ServerConfig, ServerManager

    port = args.server_port if args.server_port is not None else _free_port()
    return ServerManager(ServerConfig(
        model_path=args.model, base_port=port, device=args.server_device, dtype=args.server_dtype,
        logprob_kind=args.logprob_kind, log_dir=os.path.join(args.out, "sglang-logs")))


def _check_engine_options(args) -> None:
    if args.engine == "jax":
        if args.server_url or args.launch:
            raise ValueError("--server-url and --launch apply to SGLang only; add --engine sglang")
    elif bool(args.server_url) == bool(args.launch):
        raise ValueError("--engine sglang needs exactly one of --server-url URL (servers already "
                         "running) or --launch (start one for --model)")
    if not args.launch and (args.server_port is not None or args.server_device != "cpu"
                            or args.server_dtype != "float32"):
        raise ValueError("--server-port, --server-device and --server-dtype apply to --launch only")


def _collect_with_sglang(servers, args, prompts, params):
    from jaxrl.align.check import collect
    from jaxrl.rollout.sglang import PushConfig, SGLangEngine
    from jaxrl.rollout.sglang.client import SGLangRequestError
    from jaxrl.rollout.sglang.server import ServerStartError

    try:
        if args.launch:
            servers.start()
        # The checker never pushes weights; probe ids 0, 1 lie in any vocabulary.
        engine = SGLangEngine(servers, push=PushConfig(probe_ids=(0, 1)))
        try:
            return collect(engine, prompts, params, args.n)
        finally:
            engine.close()
    except (ServerStartError, SGLangRequestError) as err:
        raise ValueError(str(err)) from None
    finally:
        if args.launch:
            servers.stop()


def _stop_ids(args, tokenizer) -> tuple[int, ...]:
    """--stop-id, and with --tokenizer its eos and the model's own eos ids (what the trainer stops at)."""
    if tokenizer is None:
        return tuple(args.stop_id)
    from jaxrl.data import stop_token_ids

    return tuple(dict.fromkeys([*args.stop_id, *stop_token_ids(tokenizer, args.model)]))


def _cmd_run(args) -> int:
    from jaxrl.align.check import collect, score_with_learner
    from jaxrl.rollout.base import SamplingParams

    _check_engine_options(args)
    _check_out(args.out)
    _check_save_dump(args.save_dump)
    prompts, tokenizer = _prompts(args)
    _check_model_folder(args.model)
    # Cheap checks first: an unreachable server or a bad checkpoint fails before a server starts.
    servers = None
    if args.engine == "sglang":
        servers = _launched_servers(args) if args.launch else _external_servers(args.server_url, args.model)
    mesh = _parse_mesh(args.mesh)
    model = _load_model(args, mesh)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=_stop_ids(args, tokenizer),
                            seed=args.seed, logprob_kind=args.logprob_kind)
    if servers is not None:
        batch = _collect_with_sglang(servers, args, prompts, params)
    else:
        from jaxrl.rollout.sampler import JaxSampler

        engine = JaxSampler(model, max_cache_len=args.max_cache_len, max_batch=args.max_batch, mesh=mesh)
        batch = collect(engine, prompts, params, args.n)
    batch = score_with_learner(model, batch, mesh)
    if args.save_dump:
        batch.save(args.save_dump)
    return _finish(batch, args)


def _cmd_localize(args) -> int:
    import numpy as np

    from jaxrl.align import localize

    _check_out(args.out)
    prompts = _prompts(args)[0][:args.batch]
    length = min(len(p) for p in prompts)
    if length < 2:
        raise InputError(f"{args.prompts}: localisation needs prompts of at least 2 tokens; the shortest has {length}")
    ids = np.array([p[:length] for p in prompts], np.int32)  # equal lengths: no padding in either path
    model = _load_model(args)
    reference = localize.prefill_activations(model, ids)
    if args.path == "decode":
        other = localize.decode_activations(model, ids, args.prompt_length or max(1, length // 2))
        labels = ("learner prefill", "sampler decode")
    elif args.path == "mesh":
        mesh = _parse_mesh(args.mesh or "fsdp=2,tensor=2")
        other = localize.prefill_activations(model, ids, mesh=mesh)
        labels = ("learner prefill", f"prefill on mesh {args.mesh or 'fsdp=2,tensor=2'}")
    else:
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, attn_implementation="eager", dtype=torch.float32).eval()
        other = localize.hf_activations(hf, ids)
        labels = ("jaxrl learner", "transformers")
    result = localize.compare_activations(reference, other, rtol=args.rtol, atol=args.atol, labels=labels)
    os.makedirs(args.out, exist_ok=True)
    table = result.table()
    with open(os.path.join(args.out, "localization.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "localization.json"), "w") as f:
        json.dump(result.to_json(), f, indent=2)
    result.plot(os.path.join(args.out, "localization.png"))
    print(table)
    print(f"written to {args.out}")
    return 0 if result.first_divergence is None else 1


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="transformers Qwen3 / Qwen3-MoE checkpoint folder")
    p.add_argument("--prompts", required=True, help="JSON lines of token-id lists (or {\"prompt_ids\": [...]}); "
                                                    "with --tokenizer, text too")
    p.add_argument("--tokenizer", help="tokenizer folder to encode text prompts with (\"text\" or {\"prompt\": ...})")
    p.add_argument("--chat-template", action="store_true",
                   help="with --tokenizer: each text prompt as a user turn of the tokenizer's chat template")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="matmul compute dtype (default: the model's)")
    p.add_argument("--mesh", help="mesh sizes, e.g. fsdp=2,tensor=2 (default: one device)")


def _parser() -> argparse.ArgumentParser:
    from jaxrl.rollout.sglang.launch import DEVICES, DTYPES

    parser = argparse.ArgumentParser(prog="jaxrl align", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="metrics, figures and gate for a batch dump")
    p.add_argument("dump", help=".npz written by jaxrl.align.AlignmentBatch.save")
    p.add_argument("--out", required=True, help="output folder")
    _add_gate_options(p)
    p.set_defaults(run=_cmd_report)

    p = sub.add_parser("run", help="sample with an engine (JAX sampler or SGLang), recompute with the learner, report")
    _add_model_options(p)
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=("jax", "sglang"), default="jax",
                   help="jax: the embedded sampler (default); sglang: SGLang servers (--server-url or --launch)")
    e.add_argument("--server-url", action="append", default=[], metavar="URL",
                   help="an SGLang server already serving --model, e.g. http://127.0.0.1:30000 (repeatable: "
                        "prompts spread over them)")
    e.add_argument("--launch", action="store_true",
                   help="start an SGLang server for --model (stopped at the end; log in OUT/sglang-logs)")
    e.add_argument("--server-port", type=int, help="--launch: port (default: a free one)")
    e.add_argument("--server-device", choices=DEVICES, default="cpu", help="--launch: device (default cpu)")
    e.add_argument("--server-dtype", choices=DTYPES, default="float32",
                   help="--launch: SGLang --dtype (default float32, to compare with a float32 learner)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprob-kind", choices=("raw", "processed"), default="raw",
                   help="which distribution the engine's logprobs are of (raw is what the learner recomputes)")
    p.add_argument("--max-cache-len", type=int, default=None, help="jax engine: KV-cache length")
    p.add_argument("--max-batch", type=int, default=64, help="jax engine: sequences per decode batch")
    p.add_argument("--save-dump", help="also write the scored batch to this .npz")
    _add_gate_options(p)
    p.set_defaults(run=_cmd_run)

    p = sub.add_parser("localize", help="first layer/module where two paths' activations differ")
    _add_model_options(p)
    p.add_argument("--path", choices=("decode", "mesh", "hf"), default="decode",
                   help="learner prefill vs: sampler decode, prefill on --mesh, or the transformers model")
    p.add_argument("--prompt-length", type=int, help="decode: tokens prefilled before decoding (default half)")
    p.add_argument("--batch", type=int, default=8, help="prompts used (cut to the shortest one's length)")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=0.0)
    p.set_defaults(run=_cmd_localize)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as e:  # InputError (bad file, folder, row) is a ValueError
        print(f"jaxrl align: {e}", file=sys.stderr)
        return 2
