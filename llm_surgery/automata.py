"""Exact PD-SSM emulation of deterministic finite automata (paper, Proposition 1).

A DFA with N states and K input symbols becomes a dictionary of K column one-hot matrices: member a sends
state q to delta(q, a), i.e. P_a[q] = delta(q, a). With D = 1, b = 0 and x0 = onehot(start), the PD state after
each symbol is exactly the one-hot encoding of the automaton's state. Only the column (scatter) form can do this
for automata that merge states (e.g. a reset): the gather form `x[i] = x[P[i]]` cannot send two states to one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .ops.pd_scan import pd_scan
from .ops.pd_select import pd_select_scan


@dataclass(frozen=True)
class DFA:
    """delta[q][a] = next state; states 0..N-1, symbols 0..K-1."""

    delta: tuple[tuple[int, ...], ...]
    start: int = 0
    accepting: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self):
        if not self.delta or not self.delta[0]:
            raise ValueError("DFA: delta must be a non-empty table delta[state][symbol]")
        K = len(self.delta[0])
        for q, row in enumerate(self.delta):
            if len(row) != K:
                raise ValueError(f"DFA: state {q} has {len(row)} transitions, expected {K}")
            for a, nxt in enumerate(row):
                if not 0 <= nxt < len(self.delta):
                    raise ValueError(f"DFA: delta[{q}][{a}] = {nxt} is not a state (0..{len(self.delta) - 1})")
        if not 0 <= self.start < len(self.delta):
            raise ValueError(f"DFA: start state {self.start} out of range")

    @property
    def num_states(self) -> int:
        return len(self.delta)

    @property
    def num_symbols(self) -> int:
        return len(self.delta[0])

    def run(self, symbols: list[int]) -> list[int]:
        """The state after each symbol (plain simulation, the ground truth for tests)."""
        q, out = self.start, []
        for a in symbols:
            q = self.delta[q][a]
            out.append(q)
        return out


def pd_dictionary(dfa: DFA) -> torch.Tensor:
    """[K, N] int64: P_a[q] = delta(q, a), the column one-hot transition of each symbol."""
    return torch.tensor(dfa.delta, dtype=torch.long).t().contiguous()


def dictionary_logits(dfa: DFA, margin: float = 1.0) -> torch.Tensor:
    """Dense logits M [K, N, N] whose column argmax is the DFA's transitions (M[a, delta(q,a), q] = margin)."""
    P = pd_dictionary(dfa)
    K, N = P.shape
    M = torch.zeros(K, N, N)
    M.scatter_(1, P.unsqueeze(1), margin)
    return M


def track_states(dfa: DFA, symbols: torch.Tensor) -> torch.Tensor:
    """symbols [B, L] -> PD states [B, L, N] (one-hot of the DFA state after each symbol) via pd_scan."""
    if symbols.dim() != 2:
        raise ValueError(f"track_states: symbols must be [batch, length], got {tuple(symbols.shape)}")
    P = pd_dictionary(dfa)[symbols]  # [B, L, N]
    D = torch.ones(P.shape, dtype=torch.float64)
    b = torch.zeros_like(D)
    x0 = torch.zeros(symbols.shape[0], dfa.num_states, dtype=torch.float64)
    x0[:, dfa.start] = 1.0
    return pd_scan(P, D, b, x0)


def track_states_selected(dfa: DFA, symbols: torch.Tensor) -> torch.Tensor:
    """The same through Flash PD-SSM's hard selection: one head, dictionary = the DFA's symbols,
    selector logits = one-hot of the input symbol (S u_t with one-hot token embeddings)."""
    M = dictionary_logits(dfa).to(torch.float64).unsqueeze(0)  # [1, K, N, N]
    sel = torch.nn.functional.one_hot(symbols, dfa.num_symbols).to(torch.float64).unsqueeze(1)  # [B,1,L,K]
    shape = (symbols.shape[0], 1, symbols.shape[1], dfa.num_states)
    x0 = torch.zeros(symbols.shape[0], 1, dfa.num_states, dtype=torch.float64)
    x0[..., dfa.start] = 1.0
    return pd_select_scan(M, sel, torch.ones(shape, dtype=torch.float64),
                          torch.zeros(shape, dtype=torch.float64), x0).squeeze(1)


# ---- automata used in tests and benchmarks ------------------------------------------------------------------

def parity() -> DFA:
    """Symbols 0 (keep) and 1 (flip); accepts odd parity."""
    return DFA(((0, 1), (1, 0)), accepting=frozenset({1}))


def cyclic_counter(n: int, steps: tuple[int, ...] = (0, 1, -1)) -> DFA:
    """Cycle navigation / modular counting: symbol a moves the state by steps[a] mod n."""
    return DFA(tuple(tuple((q + s) % n for s in steps) for q in range(n)))


def reset_counter(n: int) -> DFA:
    """Symbol 0 increments mod n, symbol 1 resets to 0: merges every state into one (not a permutation)."""
    return DFA(tuple(((q + 1) % n, 0) for q in range(n)))


def symmetric_group(n: int, generators: tuple[tuple[int, ...], ...] | None = None) -> DFA:
    """Word problem of S_n: states are the n! permutations, symbols act by composition with a generator
    (default: the transposition (0 1) and the n-cycle)."""
    perms = list(itertools.permutations(range(n)))
    index = {p: i for i, p in enumerate(perms)}
    gens = generators or (tuple([1, 0] + list(range(2, n))), tuple(list(range(1, n)) + [0]))
    return DFA(tuple(tuple(index[tuple(g[p[i]] for i in range(n))] for g in gens) for p in perms),
               start=index[tuple(range(n))])
