"""Tokenization, padding and greedy decoding of Box examples for causal LMs.

Prompt and completion are tokenized separately and concatenated (prompt with the tokenizer's special tokens,
completion without, then EOS), so the prompt ids seen in training are exactly those given to `generate`.
Labels are -100 on the prompt and on padding; the completion and its EOS are scored.

Padding: `BoxCollator(padding_side="right")` (the default) is the plain choice for training: real tokens never
see the padding, so no layer needs to honour the attention mask. Generation needs left padding, which
`greedy_complete` always uses; the inserted mixers honour left-padding masks too (docs/design.md), so
`padding_side="left"` is also valid for training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; Box completions need one to stop generation")
    return tokenizer.eos_token_id


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)


def encode_prompts(tokenizer, contexts: Sequence[str]) -> list[list[int]]:
    """Prompt ids, with the tokenizer's special tokens (as `generate` will see them)."""
    return [list(ids) for ids in tokenizer(list(contexts), add_special_tokens=True)["input_ids"]]


def _join(prompt: list[int], answer: list[int], eos: int) -> dict[str, list[int]]:
    answer = answer + [eos]
    return {
        "input_ids": prompt + answer,
        "attention_mask": [1] * (len(prompt) + len(answer)),
        "labels": [IGNORE_INDEX] * len(prompt) + answer,
    }


def encode_example(tokenizer, context: str, target: str) -> dict[str, list[int]]:
    """input_ids = prompt + completion + EOS; labels mask the prompt with -100."""
    return encode_records(tokenizer, [{"context": context, "target": target}])[0]


def encode_records(tokenizer, records: Sequence[Mapping]) -> list[dict[str, list[int]]]:
    """`encode_example` for many records, tokenized in two batched calls."""
    if not records:
        return []
    eos = _eos_id(tokenizer)
    prompts = encode_prompts(tokenizer, [r["context"] for r in records])
    answers = tokenizer([r["target"] for r in records], add_special_tokens=False)["input_ids"]
    return [_join(p, list(a), eos) for p, a in zip(prompts, answers)]


@dataclass
class BoxCollator:
    """Pads `input_ids` (pad id, or EOS when the tokenizer has no pad), `attention_mask` (0) and `labels`
    (-100) to the longest feature, rounded up to `pad_to_multiple_of`; returns int64 tensors."""

    tokenizer: object
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    def __call__(self, features: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        pads = {"input_ids": _pad_id(self.tokenizer), "attention_mask": 0, "labels": IGNORE_INDEX}
        keys = ["input_ids", "attention_mask"] + (["labels"] if "labels" in features[0] else [])
        batch = {k: [] for k in keys}
        for f in features:
            n = len(f["input_ids"])
            for k in keys:
                if k not in f and k != "attention_mask":
                    raise ValueError(f"feature without {k!r} in a batch whose first feature has it")
                row = list(f[k]) if k in f else [1] * n  # a missing attention_mask means all tokens
                if len(row) != n:
                    raise ValueError(f"feature {k!r} has length {len(row)}, input_ids has {n}")
                fill = [pads[k]] * (length - n)
                batch[k].append(fill + row if self.padding_side == "left" else row + fill)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def clean_completion(text: str) -> str:
    """Cut at the first "." or newline, collapse spaces, and start with one space like the targets."""
    text = " ".join(text.split("\n", 1)[0].split(".", 1)[0].split())
    return f" {text}" if text else ""


@torch.inference_mode()
def greedy_complete(model, tokenizer, contexts: Sequence[str], max_new_tokens: int = 24, batch_size: int = 16,
                    progress: bool = False) -> list[str]:
    """Greedy completions of `contexts` (left-padded batches of similar length, EOS stops a row), cleaned by
    `clean_completion`, in the order of `contexts`."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    eos, pad = _eos_id(tokenizer), _pad_id(tokenizer)
    prompts = encode_prompts(tokenizer, contexts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    collate = BoxCollator(tokenizer, padding_side="left")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[str] = [""] * len(prompts)
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="generate", unit="batch")
    try:
        for start in starts:
            idx = order[start:start + batch_size]
            batch = collate([{"input_ids": prompts[i]} for i in idx])
            generated = model.generate(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad)
            for i, row in zip(idx, generated[:, batch["input_ids"].shape[1]:].tolist()):
                if eos in row:
                    row = row[:row.index(eos)]
                out[i] = clean_completion(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out
