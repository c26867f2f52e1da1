"""Data: JSONL/Parquet prompt datasets tokenised with a local tokenizer, served by Grain."""

from jaxrl.errors import InputError, needs_extra

# Without the [train] extra (grain, transformers) an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.data"):
    from jaxrl.data.pipeline import AllRowsBadError, BatchIterator, DataConfig, Example, LoadReport, load_examples
    from jaxrl.data.sources import Row, read_rows
    from jaxrl.data.tokenizer import encode_prompt, load_tokenizer, make_char_tokenizer, stop_token_ids

__all__ = [
    "AllRowsBadError", "BatchIterator", "DataConfig", "Example", "InputError", "LoadReport", "Row", "encode_prompt",
    "load_examples", "load_tokenizer", "make_char_tokenizer", "read_rows", "stop_token_ids",
]
