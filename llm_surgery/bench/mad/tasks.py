"""The six MAD tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures"), generated as
MAD's task generators define them, at the baseline settings of MAD's task configs.

Each generator draws `n` sequences at once from a numpy Generator and returns (inputs, targets), int64 arrays of
shape (n, L). Targets hold IGNORE where a position is not scored. Like MAD, the recall tasks have two target
kinds: for training, every next token (the sequence shifted by one); for evaluation, only the values of keys that
occurred earlier in the sequence. The other tasks use one kind for both.

Where ours differs from MAD's code (same task, clearer guarantee), the generator's docstring says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import permutations
from typing import Callable

import numpy as np

IGNORE = -100  # target of an unscored position (MAD's target_ignore_idx, torch's cross-entropy default)


def in_context_recall(rng: np.random.Generator, n: int, train: bool, vocab_size: int = 16, seq_len: int = 128,
                      noise_vocab_size: int = 0, frac_noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Multi-query associative recall. Each sequence has its own random key -> value map (keys: the lower half of
    the non-noise vocabulary, values: the upper half) and is seq_len/2 - 1 pairs "key value", then a final pair
    whose key already occurred. Scored: every value whose key occurred earlier. With frac_noise > 0 each pair is,
    with that probability, two tokens of the noise vocabulary instead (at least one pair is a real one); noise
    tokens are never keys or values. Inputs are the sequence without its last token (length seq_len - 1)."""
    if seq_len % 2 or seq_len < 4:
        raise ValueError(f"in-context recall needs an even seq_len >= 4, got {seq_len}")
    n_tok = vocab_size - noise_vocab_size  # multi-query: no copy-prefix token
    n_keys = n_tok // 2
    if n_keys < 1 or n_tok - n_keys < 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no keys or values beside {noise_vocab_size} noise tokens")
    pairs = seq_len // 2 - 1  # before the final query pair
    keys = rng.integers(0, n_keys, (n, pairs))
    table = rng.integers(n_keys, n_tok, (n, n_keys))  # a value for each key, drawn when the key first occurs
    values = np.take_along_axis(table, keys, axis=1)
    noise = rng.random((n, pairs)) < frac_noise
    noise[np.arange(n), rng.integers(0, pairs, n)] = False  # at least one real pair
    noise_tokens = rng.integers(n_tok, n_tok + max(noise_vocab_size, 1), (n, pairs, 2))
    onehot = (keys[..., None] == np.arange(n_keys)) & ~noise[..., None]
    seen = np.cumsum(onehot, axis=1) - onehot  # occurrences of each key in the real pairs before this one
    repeated = np.take_along_axis(seen, keys[..., None], axis=2)[..., 0] > 0
    body = np.where(noise[..., None], noise_tokens, np.stack([keys, values], axis=-1)).reshape(n, -1)
    scored = np.stack([np.full_like(keys, IGNORE), np.where(~noise & repeated, values, IGNORE)], -1).reshape(n, -1)
    presented = onehot.any(axis=1)
    query = np.argmax(np.where(presented, rng.random((n, n_keys)), -1.0), axis=1)  # a random key that occurred
    answer = table[np.arange(n), query]
    tokens = np.concatenate([body, query[:, None], answer[:, None]], axis=1)
    scored = np.concatenate([scored, np.full((n, 1), IGNORE), answer[:, None]], axis=1)
    return tokens[:, :-1], (tokens if train else scored)[:, 1:]


def noisy_in_context_recall(rng, n, train, vocab_size=32, seq_len=128, noise_vocab_size=16, frac_noise=0.2):
    """In-context recall with noise pairs between the key-value pairs (MAD: a separate noise vocabulary of 16)."""
    return in_context_recall(rng, n, train, vocab_size, seq_len, noise_vocab_size, frac_noise)


def fuzzy_in_context_recall(rng: np.random.Generator, n: int, train: bool, vocab_size: int = 16,
                            seq_len: int = 128, k_motif_size: int = 3, v_motif_size: int = 3
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Recall where keys and values are runs of 1..k_motif_size (1..v_motif_size) distinct tokens; evaluation
    sequences use keys of exactly k_motif_size tokens. One "probe" pair is placed at a random point and asked
    for again at the end. Sequences are left-padded (pad = the last token) to seq_len + 1, then shifted.
    Scored: the value tokens of keys that occurred earlier. Unlike MAD's code, whose probe can fall past the
    last pair (its final query then has no answer in the sequence), the probe always lies inside the sequence."""
    pad = vocab_size - 1
    n_tok = vocab_size - 1
    key_vocab, value_vocab = range(n_tok // 2), range(n_tok // 2, n_tok)
    key_sizes = list(range(1, k_motif_size + 1)) if train else [k_motif_size]
    keys = {s: list(permutations(key_vocab, s)) for s in key_sizes}
    values = {s: list(permutations(value_vocab, s)) for s in range(1, v_motif_size + 1)}
    room = seq_len - (k_motif_size + v_motif_size)  # pairs are added while the sequence is shorter than this

    def draw(motifs: dict) -> tuple:
        pool = motifs[list(motifs)[rng.integers(len(motifs))]]
        return pool[rng.integers(len(pool))]

    inputs, targets = np.full((n, seq_len), pad), np.full((n, seq_len), IGNORE)
    for i in range(n):
        probe_key, probe_value = draw(keys), draw(values)
        limit = room - len(probe_key) - len(probe_value)
        longest = k_motif_size + v_motif_size  # the most one pair adds: a pair starts in [probe_at, limit)
        if limit < longest:
            raise ValueError(f"fuzzy recall: seq_len {seq_len} is too short for motifs of {k_motif_size}, "
                             f"{v_motif_size}")
        probe_at = rng.integers(limit - longest + 1)
        kv, seen, tokens, scored = {probe_key: probe_value}, set(), [], []
        while len(tokens) < limit:
            key = probe_key if probe_key not in seen and len(tokens) >= probe_at else draw(keys)
            value = kv.setdefault(key, draw(values))
            tokens += [*key, *value]
            scored += [IGNORE] * len(key) + (list(value) if key in seen else [IGNORE] * len(value))
            seen.add(key)
        tokens += [*probe_key, *probe_value]
        scored += [IGNORE] * len(probe_key) + list(probe_value)
        padded = np.full(seq_len + 1, pad)
        padded[-len(tokens):] = tokens
        inputs[i] = padded[:-1]
        if train:  # every next token, the padding too (MAD shifts the padded sequence)
            targets[i] = padded[1:]
        else:
            targets[i, seq_len + 1 - len(scored):] = scored[1:]
    return inputs, targets


def memorize_table(vocab_size: int, map_seed: int) -> np.ndarray:
    """The fixed key -> value map of the memorize task: key k (0..K-1) -> table[k], distinct values from the upper
    half of the vocabulary, the same for every sequence (MAD draws it once from a fixed seed)."""
    n_tok = vocab_size - 1  # the last token is the insert token
    n_keys = n_tok // 2
    return np.random.default_rng(map_seed).permutation(np.arange(n_keys, n_tok))[:n_keys]


def memorize(rng: np.random.Generator, n: int, train: bool, vocab_size: int = 256, seq_len: int = 32,
             map_seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """Fact memorisation: seq_len/2 pairs "key insert"; scored at each insert token: the key's value under the
    fixed map (memorize_table), which the sequence never shows."""
    table = memorize_table(vocab_size, map_seed)
    keys = rng.integers(0, len(table), (n, seq_len // 2))
    inputs = np.stack([keys, np.full_like(keys, vocab_size - 1)], -1).reshape(n, -1)
    targets = np.stack([np.full_like(keys, IGNORE), table[keys]], -1).reshape(n, -1)
    return inputs, targets


def compress(rng: np.random.Generator, n: int, train: bool, vocab_size: int = 16, seq_len: int = 32
             ) -> tuple[np.ndarray, np.ndarray]:
    """Compression: seq_len - 1 random tokens then the compression token; the target is the input itself, to be
    decoded from the model's state at the last position (the model's autoencoder head)."""
    tokens = rng.integers(0, vocab_size - 1, (n, seq_len))
    tokens[:, -1] = vocab_size - 1
    return tokens, tokens.copy()


def selective_copy(rng: np.random.Generator, n: int, train: bool, vocab_size: int = 16, seq_len: int = 256,
                   num_tokens_to_copy: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Selective copying: num_tokens_to_copy tokens scattered among blanks, a copy token, then as many blanks,
    at which the tokens are to be output in order. The blanks fall into the gaps before each token to copy (each
    blank picks a gap uniformly, as MAD's random insertion does: none follow the last token to copy)."""
    m = num_tokens_to_copy
    n_blank = seq_len - 2 * m - 1
    if n_blank < 0:
        raise ValueError(f"selective copy needs seq_len > 2 * num_tokens_to_copy, got {seq_len}, {m}")
    blank, copy = vocab_size - 2, vocab_size - 1
    to_copy = rng.integers(0, vocab_size - 2, (n, m))
    gaps = rng.multinomial(n_blank, np.full(m, 1.0 / m), size=n)
    where = np.cumsum(gaps, axis=1) + np.arange(m)  # position of each token to copy
    inputs = np.full((n, seq_len), blank)
    np.put_along_axis(inputs, where, to_copy, axis=1)
    inputs[:, seq_len - m - 1] = copy
    targets = np.full((n, seq_len), IGNORE)
    targets[:, seq_len - m:] = to_copy
    return inputs, targets


@dataclass(frozen=True)
class Task:
    """A MAD task at its baseline setting (MAD's configs/tasks/<mad_name>.yml and MADConfig's defaults)."""
    name: str
    mad_name: str
    generate: Callable
    settings: dict = field(default_factory=dict)
    num_train: int = 12_800
    autoencoder: bool = False  # compression: MAD's autoencoder backbone (decode the sequence from the last state)

    @property
    def vocab_size(self) -> int:
        return self.settings["vocab_size"]

    def sample(self, n: int, train: bool, seed) -> tuple[np.ndarray, np.ndarray]:
        """`n` sequences from the stream `seed` (an int or a sequence of ints: numpy's SeedSequence entropy)."""
        return self.generate(np.random.default_rng(seed), n, train, **self.settings)


TASKS = {t.name: t for t in (
    Task("compress", "compression", compress, dict(vocab_size=16, seq_len=32), autoencoder=True),
    Task("fuzzy_in_context_recall", "fuzzy-in-context-recall", fuzzy_in_context_recall,
         dict(vocab_size=16, seq_len=128, k_motif_size=3, v_motif_size=3)),
    Task("in_context_recall", "in-context-recall", in_context_recall, dict(vocab_size=16, seq_len=128)),
    Task("memorize", "memorization", memorize, dict(vocab_size=256, seq_len=32), num_train=256),
    Task("noisy_in_context_recall", "noisy-in-context-recall", noisy_in_context_recall,
         dict(vocab_size=32, seq_len=128, noise_vocab_size=16, frac_noise=0.2)),
    Task("selective_copy", "selective-copying", selective_copy,
         dict(vocab_size=16, seq_len=256, num_tokens_to_copy=16)),
)}
# The paper's column order (Compress, Fuzzy Rec., IC Rec., Memorize, Noisy Rec., Sel. Copy)
TASK_ORDER = tuple(TASKS)
NUM_TEST = 1_280  # MAD's num_test_examples; the held-out validation split (learning-rate choice) has as many
