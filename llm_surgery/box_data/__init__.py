"""The extended Box natural-language state-tracking dataset: generator, files, scorer, tokenizer, collation.

    from llm_surgery.box_data import generate_splits, write_splits, score
    splits = generate_splits(num_sequences=1000, seed=2255)   # {"train": [...], "validation": [...], "test": [...]}

The torch/transformers parts (`build_box_tokenizer`, `encode_example`, `BoxCollator`, `greedy_complete`) are
imported on first use so that the generator stays light.
"""

from .files import read_jsonl, write_splits
from .generate import (DISJOINT_SPLIT, MAX_PER_BOX, NUM_BOXES, SPLITS, generate_split, generate_splits,
                       signature_partition)
from .score import is_correct, parse_completion, score
from .vocab import COMMON_OBJECTS, RARE_OBJECTS

_LAZY = {
    "build_box_tokenizer": "tokenizer",
    "encode_example": "collate",
    "encode_records": "collate",
    "encode_prompts": "collate",
    "BoxCollator": "collate",
    "greedy_complete": "collate",
    "clean_completion": "collate",
    "IGNORE_INDEX": "collate",
}

__all__ = ["COMMON_OBJECTS", "DISJOINT_SPLIT", "MAX_PER_BOX", "NUM_BOXES", "RARE_OBJECTS", "SPLITS",
           "generate_split", "generate_splits", "is_correct", "parse_completion", "read_jsonl", "score",
           "signature_partition", "write_splits", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
