"""Synthetic state-tracking tasks: random token sequences whose label is the final state of an automaton.

Deletang et al. (2023) regular tasks (the paper's Table 1): parity, even pairs, cycle navigation, modular
arithmetic without brackets; and group word problems: S3 and A5, with every group element as a token
or only two generators. Every sequence starts with a BOS token (id `vocab_size - 1`) marking the start state.
All rows of one batch share a length; labels are computed here with batched torch code, and the tests check
them against independent plain-Python / DFA / permutation-matrix implementations.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from ... import automata


@dataclass(frozen=True)
class Task:
    """A task: `sample(batch, length, generator) -> (symbols [B, length] int64, labels [B] int64)`."""

    name: str
    num_symbols: int
    num_classes: int
    sample: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    odd_lengths: bool = False  # modular arithmetic: expressions have odd length

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + 1  # + BOS

    @property
    def bos(self) -> int:
        return self.num_symbols

    def batch(self, batch_size: int, min_len: int, max_len: int, generator: torch.Generator):
        """(tokens [B, 1 + L] with BOS first, labels [B]); L uniform in [min_len, max_len] (odd if needed)."""
        if not 1 <= min_len <= max_len:
            raise ValueError(f"{self.name}: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        if self.odd_lengths and L % 2 == 0:
            L = L - 1 if L > min_len else L + 1
        symbols, labels = self.sample(batch_size, L, generator)
        tokens = torch.cat([torch.full((batch_size, 1), self.bos, dtype=torch.long), symbols], dim=1)
        return tokens, labels


def _uniform(batch_size: int, length: int, n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, (batch_size, length), generator=generator)


# ---- Deletang et al. regular tasks ------------------------------------------------------------------------------

def _parity(batch_size, length, generator):
    x = _uniform(batch_size, length, 2, generator)
    return x, x.sum(1) % 2


def _even_pairs(batch_size, length, generator):
    """Binary strings; 1 iff the number of '01' and '10' pairs is even, i.e. first symbol == last symbol."""
    x = _uniform(batch_size, length, 2, generator)
    changes = (x[:, 1:] != x[:, :-1]).sum(1)
    return x, (changes % 2 == 0).long()


def _cycle_navigation(batch_size, length, generator, n: int = 5):
    """Symbols 0, 1, 2 move by -1, 0, +1 on a cycle of 5 positions starting at 0; label = final position."""
    x = _uniform(batch_size, length, 3, generator)
    return x, (x - 1).sum(1) % n


MOD_ARITH_OPS = "+-*"  # tokens modulus + i


def _modular_arithmetic(batch_size, length, generator, modulus: int = 5):
    """Odd-length expressions `n op n op ... n` (n in 0..4, op in + - *), evaluated with the usual precedence
    modulo 5, left to right with a (sum, current product) state: that is the automaton."""
    if length % 2 == 0:
        raise ValueError(f"modular_arithmetic: expression length must be odd, got {length}")
    nums = _uniform(batch_size, length // 2 + 1, modulus, generator)
    ops = _uniform(batch_size, length // 2, len(MOD_ARITH_OPS), generator)
    x = torch.empty(batch_size, length, dtype=torch.long)
    x[:, 0::2], x[:, 1::2] = nums, ops + modulus
    total = torch.zeros(batch_size, dtype=torch.long)
    term = nums[:, 0].clone()  # signed product being built
    for i in range(ops.shape[1]):
        op, n = ops[:, i], nums[:, i + 1]
        close = op != 2  # + or -: the current product is finished
        total = torch.where(close, (total + term) % modulus, total)
        term = torch.where(op == 0, n, torch.where(op == 1, (-n) % modulus, (term * n) % modulus))
    return x, (total + term) % modulus


# ---- group word problems ----------------------------------------------------------------------------------------

def permutation_group(n: int, alternating: bool = False) -> list[tuple[int, ...]]:
    """Elements of S_n (or A_n), identity first, as tuples p with p[i] = image of i."""
    perms = list(itertools.permutations(range(n)))
    if alternating:
        perms = [p for p in perms if _sign(p) == 1]
    return perms


def _sign(p) -> int:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return -1 if inversions % 2 else 1


def compose_table(perms: list[tuple[int, ...]]) -> torch.Tensor:
    """T[g, s] = index of g o s (apply s, then g)."""
    index = {p: i for i, p in enumerate(perms)}
    return torch.tensor([[index[tuple(g[s[i]] for i in range(len(s)))] for s in perms] for g in perms])


def _word_problem(perms, symbol_elements, table):
    """Tokens name group elements (symbol k -> element symbol_elements[k]); label = g_L o ... o g_1."""
    def sample(batch_size, length, generator):
        x = _uniform(batch_size, length, len(symbol_elements), generator)
        g = symbol_elements[x]
        state = torch.zeros(batch_size, dtype=torch.long)  # identity
        for t in range(length):
            state = table[g[:, t], state]
        return x, state
    return sample


GENERATORS = {  # two generators of each group
    "s3": ((1, 0, 2), (1, 2, 0)),                 # (0 1) and (0 1 2)
    "a5": ((1, 2, 0, 3, 4), (1, 2, 3, 4, 0)),     # (0 1 2) and (0 1 2 3 4)
}


GROUPS = {"s3": (3, False), "a5": (5, True)}   # points permuted, alternating


def group_word_problem(name: str) -> tuple[list[tuple[int, ...]], list[int], torch.Tensor]:
    """A group task (s3, a5, s3_gen, a5_gen): the group's elements as permutations (identity first; index = class
    label), each symbol's element (its index) and the composition table (compose_table)."""
    base = name.split("_")[0]
    if base not in GROUPS or name not in (base, base + "_gen"):
        raise ValueError(f"task {name!r} is not a group word problem (s3, a5, s3_gen, a5_gen)")
    perms = permutation_group(*GROUPS[base])
    index = {p: i for i, p in enumerate(perms)}
    elements = [index[g] for g in GENERATORS[base]] if name.endswith("_gen") else list(range(len(perms)))
    return perms, elements, compose_table(perms)


def _group_task(name: str) -> Task:
    perms, elements, table = group_word_problem(name)
    return Task(name, len(elements), len(perms), _word_problem(perms, torch.tensor(elements), table))


TASKS: dict[str, Callable[[], Task]] = {
    "parity": lambda: Task("parity", 2, 2, _parity),
    "even_pairs": lambda: Task("even_pairs", 2, 2, _even_pairs),
    "cycle_navigation": lambda: Task("cycle_navigation", 3, 5, _cycle_navigation),
    "modular_arithmetic": lambda: Task("modular_arithmetic", 5 + len(MOD_ARITH_OPS), 5, _modular_arithmetic,
                                       odd_lengths=True),
    "s3": lambda: _group_task("s3"),
    "a5": lambda: _group_task("a5"),
    "s3_gen": lambda: _group_task("s3_gen"),
    "a5_gen": lambda: _group_task("a5_gen"),
}
TABLE1_TASKS = ("cycle_navigation", "even_pairs", "modular_arithmetic", "parity")


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]()


def parity_batch(batch_size: int, min_len: int, max_len: int, generator: torch.Generator):
    """Parity with BOS token 2 first; kept for the foundation's parity scripts. Labels from the parity DFA."""
    L = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
    bits = torch.randint(0, 2, (batch_size, L), generator=generator)
    tokens = torch.cat([torch.full((batch_size, 1), 2), bits], dim=1)
    labels = torch.tensor([automata.parity().run(row)[-1] if L else 0 for row in bits.tolist()])
    return tokens, labels
