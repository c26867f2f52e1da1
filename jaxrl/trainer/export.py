"""``checkpoint.export_hf``: the trained policy as a folder that transformers and SGLang load whole.

The weights and ``config.json`` (``jaxrl.models.save_hf_checkpoint``), the run's tokenizer
(``data.tokenizer``, its ``save_pretrained`` files: without them transformers silently loads an
empty tokenizer from the folder) and a ``generation_config.json`` naming the ids generation stops
at, as the trainer's engines did (``jaxrl.data.stop_token_ids``: the tokenizer's eos and the
source checkpoint's), and the pad id. A ``generation_config.json`` of ``model.hf_path`` (sampling
defaults such as Qwen3's temperature 0.6) is kept, with those ids set. Every file is 0644, as a
``save_pretrained`` writes them. ``config.json`` is written last, so a folder that has one is whole.
"""

from __future__ import annotations

import json
import os

from jaxrl import distributed
from jaxrl.data import stop_token_ids
from jaxrl.models import save_hf_checkpoint

GENERATION_CONFIG = "generation_config.json"


def generation_config(tokenizer, source_path: str) -> dict:
    """The export's generation_config.json: the source checkpoint's (if any), with its stop and pad ids."""
    config = {}
    source = os.path.join(source_path, GENERATION_CONFIG) if source_path else ""
    if source and os.path.isfile(source):
        with open(source) as f:
            config = json.load(f)
    stops = list(stop_token_ids(tokenizer, source_path))
    config.update(eos_token_id=stops[0] if len(stops) == 1 else stops, pad_token_id=tokenizer.pad_token_id)
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    return config


def export_hf(model, tokenizer, source_path: str, path: str) -> None:
    """Writes the folder (module docstring); every JAX process calls it (the weights' gather is a
    collective) and process 0 writes."""
    if distributed.is_main_process():
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, GENERATION_CONFIG), "w") as f:
            json.dump(generation_config(tokenizer, source_path), f, indent=2, sort_keys=True)
        for name in (*tokenizer.save_pretrained(path), os.path.join(path, GENERATION_CONFIG)):
            if os.path.isfile(name):
                os.chmod(name, 0o644)
    save_hf_checkpoint(model, path)
