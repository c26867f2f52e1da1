"""``checkpoint.export_hf`` writes a folder transformers loads whole: weights, config, the run's
tokenizer, a generation config with the ids generation stops at, every file readable (0644).

Before, the folder held the weights and config.json only: ``AutoTokenizer.from_pretrained`` on it
failed or (with a tokenizer class in config.json) silently built an empty one, and
model.safetensors was 0600 (safetensors writes it so), unreadable to anyone else on a shared host.
"""

import json
import os
import shutil
import stat

import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.data import load_tokenizer
from jaxrl.demo import write_demo_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT = os.path.join(ROOT, "configs", "demo_sft.yaml")


def _sft(files, out, *overrides) -> str:
    export = str(out / "hf")
    assert main(["sft", SFT, f"output_dir={out}", f"data.tokenizer={files['tokenizer']}",
                 f"data.train_files=[{files['train']}]", "sft.stages=[{steps: 2, max_length: 16}]",
                 "sft.batch_size=8", f"checkpoint.export_hf={export}", "logging.progress=false",
                 "logging.tensorboard=false", "logging.plots=false", *overrides]) == 0
    return export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    files = write_demo_files(str(root / "demo"), max_operand=10, heldout=10)
    return files, _sft(files, root / "sft"), root


def test_the_export_is_a_whole_folder_every_file_readable(exported):
    files, export, _ = exported
    names = sorted(os.listdir(export))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(names), names
    for name in names:
        assert stat.S_IMODE(os.stat(os.path.join(export, name)).st_mode) == 0o644, name


def test_transformers_loads_the_tokenizer_model_and_generation_config(exported):
    import torch
    import transformers

    files, export, _ = exported
    ours = load_tokenizer(files["tokenizer"])
    theirs = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    text = "12+34=\\boxed{46}"
    assert theirs(text)["input_ids"] == ours(text)["input_ids"] and len(theirs) == len(ours)
    generation = transformers.GenerationConfig.from_pretrained(export, local_files_only=True)
    assert generation.eos_token_id == ours.eos_token_id and generation.pad_token_id == ours.pad_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    ids = torch.tensor([ours(text)["input_ids"]])
    assert np.isfinite(model(ids).logits.detach().numpy()).all()


def test_the_source_generation_config_is_kept_with_the_run_stop_ids(exported, tmp_path):
    """An export of a run that started from a checkpoint keeps that checkpoint's sampling defaults
    (Qwen3 ships temperature 0.6, top_p 0.95) and its extra stop ids."""
    files, first, _ = exported
    source = tmp_path / "source"
    shutil.copytree(first, source)
    eos = load_tokenizer(files["tokenizer"]).eos_token_id
    (source / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95,
                                                               "eos_token_id": [eos, 3]}))
    export = _sft(files, tmp_path / "again", f"model.hf_path={source}")
    with open(os.path.join(export, "generation_config.json")) as f:
        written = json.load(f)
    assert written["temperature"] == 0.6 and written["top_p"] == 0.95
    assert written["eos_token_id"] == [eos, 3]
