"""Tokenizers from local folders, prompt encoding with the chat template, and a tiny local tokenizer.

No model hub: ``load_tokenizer`` reads a folder written by ``save_pretrained``.
``make_char_tokenizer`` builds a character-level tokenizer (plus a few whole-word
tokens) with the ``tokenizers`` library, for the CPU demo and tests.
"""

from __future__ import annotations

import os
from typing import Sequence


def load_tokenizer(path: str):
    """A ``transformers`` tokenizer from a local folder (no downloads)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer folder {path!r} does not exist; set data.tokenizer to a folder with tokenizer.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer at {path!r} has no eos token; generation could never stop")
    return tokenizer


def encode_prompt(tokenizer, prompt: str, *, use_chat_template: bool = True, system_prompt: str | None = None) -> list[int]:
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
