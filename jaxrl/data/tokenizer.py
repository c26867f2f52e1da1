"""Tokenizers from local folders, prompt encoding with the chat template, and a tiny local tokenizer.

No model hub: ``load_tokenizer`` reads a folder written by ``save_pretrained``.
``make_char_tokenizer`` builds a character-level tokenizer (plus a few whole-word
tokens) with the ``tokenizers`` library, for the CPU demo and tests.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from jaxrl.errors import InputError, InputFileNotFoundError, one_line


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
_EXPECTED = "a folder written by save_pretrained (tokenizer.json + tokenizer_config.json)"


def load_tokenizer(path: str):
    """A ``transformers`` tokenizer from a local folder (no downloads).

    A missing folder, a folder with no tokenizer files, a tokenizer.json that is not
    valid JSON or that transformers cannot build, and a tokenizer without an eos token
    raise ``InputError`` naming the folder or file and what is expected. A tokenizer without a pad
    token pads with its eos token (as transformers' own trainers do).
    """
    if not os.path.exists(path):
        raise InputFileNotFoundError(
            f"tokenizer folder {path!r} does not exist; set data.tokenizer to {_EXPECTED}")
    if not os.path.isdir(path):
        raise InputError(f"tokenizer {path!r} is a file, not a folder; set data.tokenizer to {_EXPECTED}")
    try:
        present = sorted(os.listdir(path))
    except OSError as e:
        raise InputError(f"tokenizer folder {path!r} cannot be read ({one_line(e.strerror or e)})") from e
    if not any(name in present for name in TOKENIZER_FILES):
        holds = f"it holds {present[:8]}{' ...' if len(present) > 8 else ''}" if present else "it is empty"
        raise InputError(f"tokenizer folder {path!r} has no tokenizer files ({holds}); expected {_EXPECTED}")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        try:
            with open(tokenizer_json, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        except (ValueError, OSError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InputError(f"{tokenizer_json} is not valid JSON ({one_line(e)}); the file is truncated or "
                             f"corrupt: copy it again, or re-save the tokenizer with save_pretrained") from e
    try:
        tokenizer = _tokenizer_class(path, present).from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, TypeError, tokenizers' Exception...
        raise InputError(f"tokenizer folder {path!r} cannot be loaded by transformers ({type(e).__name__}: "
                         f"{one_line(e)}); expected {_EXPECTED}") from e
    if tokenizer.eos_token_id is None:
        raise InputError(f"tokenizer at {path!r} has no eos token; generation could never stop. Set eos_token "
                         "in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:  # a pad only fills rows and is masked out of every loss: any id does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# The tokenizer_class values saved by transformers' own generic fast tokenizer (ours, make_char_tokenizer's).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: str, present: list[str]):
    """The class ``AutoTokenizer`` would load ``path`` with, without importing ``AutoTokenizer``
    where that class is plain: a folder with no model config.json whose tokenizer_config.json
    names transformers' generic fast tokenizer (and no ``auto_map``) is loaded by
    ``AutoTokenizer`` with exactly that class. ``AutoTokenizer``'s module imports torch (through
    transformers' model configurations): 3-4 s of a CLI's start on a 2-core machine, for a class
    it would not use. Every other folder (a model's, a Qwen tokenizer's) goes through
    ``AutoTokenizer``, which resolves the model-specific class."""
    config = {}
    if "config.json" not in present and "tokenizer_config.json" in present:
        try:
            with open(os.path.join(path, "tokenizer_config.json"), "rb") as f:
                config = json.loads(f.read().decode("utf-8"))
        except (ValueError, OSError, RecursionError):
            pass  # AutoTokenizer reads it again and names what is wrong
    if isinstance(config, dict) and config.get("tokenizer_class") in _GENERIC_CLASSES and "auto_map" not in config:
        from transformers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def stop_token_ids(tokenizer, model_path: str = "") -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's eos, then each ``eos_token_id`` (one id or a
    list) of ``model_path``'s config.json and generation_config.json, e.g. Qwen3's ``<|im_end|>``
    and ``<|endoftext|>``. SGLang stops on all of the model's own end-of-sequence ids whatever a
    request asks (``jaxrl.rollout.sglang.client.sampling_payload``), so both engines are given
    these, and stop at the same tokens."""
    ids = [tokenizer.eos_token_id]
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_path, name) if model_path else ""
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable config stops the model's own loading, with its own message
        ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    return tuple(dict.fromkeys(ids))


def encode_prompt(tokenizer, prompt: str, *, use_chat_template: bool = True,
                  system_prompt: str | None = None) -> list[int]:
    """Prompt text -> token ids; with the chat template (user turn + generation prompt) when it has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = f"{system_prompt}\n{prompt}" if system_prompt else prompt
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_char_tokenizer(folder: str, alphabet: str, words: Sequence[str] = (), chat_template: str | None = None):
    """Saves a character-level tokenizer to ``folder`` and returns it (a PreTrainedTokenizerFast).

    Tokens: ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2), each character of ``alphabet``,
    then each of ``words`` as one token (e.g. ``"\\boxed{"``), matched greedily before characters.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(folder)
    return fast
