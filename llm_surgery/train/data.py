"""Box data for the trainer: generated splits, tokenized examples, and a resumable per-process batch sampler.

The sampler owns the data order so that a resumed run sees exactly the batches an uninterrupted run would: each
epoch is a permutation drawn from (seed, epoch); global batches of `batch_size x world_size` examples are cut
from it in order, and rank r takes the r-th slice. The position is (epoch, batch index), derived from the
optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from llm_surgery.box_data import encode_records, generate_splits

from .config import UsageError


def make_splits(num_sequences: int, seed: int, train_max_ops: int, test_max_ops: int) -> dict[str, list[dict]]:
    """train / validation (0..train_max_ops operations) and test (0..test_max_ops) Box records."""
    return generate_splits(num_sequences=num_sequences, seed=seed, train_max_ops=train_max_ops,
                           test_max_ops=test_max_ops)


def check_splits(cfg, world_size: int) -> dict[str, list[dict]]:
    """The run's splits, refused before any work when one is empty or too small to fill one global batch."""
    splits = make_splits(cfg.num_sequences, cfg.data_seed, cfg.train_max_ops, cfg.test_max_ops)
    if len(splits["train"]) < cfg.batch_size * world_size:
        raise UsageError(f"--num-sequences {cfg.num_sequences} gives {len(splits['train'])} training examples, fewer "
                         f"than one global batch of {cfg.batch_size} x {world_size} processes; raise --num-sequences "
                         "or lower --batch-size")
    for name in ("validation", "test"):
        if not cap_records(splits[name], cfg.max_eval_examples):
            raise UsageError(f"--num-sequences {cfg.num_sequences} gives no {name} examples to evaluate; raise "
                             "--num-sequences")
    return splits


def cap_records(records: Sequence[dict], max_examples: int | None) -> list[dict]:
    """At most `max_examples` records (all when None), taken so that the subset stays as uniform over the number
    of operations as the cap allows and whole-state accuracy stays defined: whole sequences while they fit, then
    whole states (every box at one number of operations) of the next sequence at evenly spread numbers of
    operations. A cap below one state takes the first records."""
    if max_examples is None or len(records) <= max_examples:
        return list(records)
    sequences: dict = {}
    for r in records:
        sequences.setdefault(r["sequence_id"], []).append(r)
    out = []
    for seq in sequences.values():
        if len(out) + len(seq) > max_examples:  # the first sequence that does not fit: some of its states
            states: dict = {}
            for r in seq:
                states.setdefault(r["num_ops"], []).append(r)
            groups = list(states.values())
            k = (max_examples - len(out)) // max(len(g) for g in groups)
            for j in range(k):  # the centres of k equal segments of its numbers of operations
                out += groups[(2 * j + 1) * len(groups) // (2 * k)]
            break
        out += seq
    return out or list(records[:max_examples])


class TokenizedBox(torch.utils.data.Dataset):
    """Records encoded once (prompt + completion + EOS, prompt labels masked)."""

    def __init__(self, tokenizer, records: Sequence[dict]):
        self.records = list(records)
        self.features = encode_records(tokenizer, self.records)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> dict:
        return self.features[i]


class ShardedBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of indices, from a given (epoch, batch) position, forever.

    Every epoch has `batches_per_epoch` global batches (the incomplete tail is dropped so that every rank
    steps the same number of times).
    """

    def __init__(self, num_examples: int, batch_size: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.num_examples, self.batch_size = num_examples, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = num_examples // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{num_examples} training examples cannot fill one global batch of "
                             f"{batch_size} x {world_size} processes; generate more data or lower --batch-size")
        self.epoch, self.batch = 0, 0

    def set_position(self, micro_batches_done: int) -> None:
        self.epoch, self.batch = divmod(micro_batches_done, self.batches_per_epoch)

    def position(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch}

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=g)

    def _shard(self, perm: torch.Tensor, batch: int) -> list[int]:
        start = batch * self.global_batch + self.rank * self.batch_size
        return perm[start:start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            perm = self._perm(self.epoch)
            while self.batch < self.batches_per_epoch:
                self.batch += 1
                yield self._shard(perm, self.batch - 1)
            self.epoch, self.batch = self.epoch + 1, 0

    def ahead(self, micro_batches_done: int, count: int) -> Iterator[list[int]]:
        """This rank's next `count` micro-batches from that position, as iterating would give them (the position
        does not move)."""
        epoch, batch = divmod(micro_batches_done, self.batches_per_epoch)
        perm = self._perm(epoch)
        for _ in range(count):
            if batch == self.batches_per_epoch:
                epoch, batch = epoch + 1, 0
                perm = self._perm(epoch)
            yield self._shard(perm, batch)
            batch += 1

    def __len__(self) -> int:
        return self.batches_per_epoch
