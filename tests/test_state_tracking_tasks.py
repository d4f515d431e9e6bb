"""Task generators of the state-tracking benchmark, checked against independent implementations: the DFAs of
llm_surgery.automata, plain Python (eval, string counting) and permutation matrices."""

import itertools

import pytest
import torch

from llm_surgery import automata
from llm_surgery.bench.state_tracking.tasks import MOD_ARITH_OPS, TASKS, get_task, parity_batch


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _sample(name, batch=64, length=17, seed=0):
    task = get_task(name)
    tokens, labels = task.batch(batch, length, length, _gen(seed))
    assert (tokens[:, 0] == task.bos).all() and task.bos == task.vocab_size - 1
    assert tokens.max() < task.vocab_size and labels.max() < task.num_classes and labels.min() >= 0
    return task, tokens[:, 1:].tolist(), labels.tolist()


def test_parity_matches_dfa():
    _, rows, labels = _sample("parity")
    assert labels == [automata.parity().run(r)[-1] for r in rows]
    assert 0 < sum(labels) < len(labels)


def test_even_pairs_counts_pairs():
    _, rows, labels = _sample("even_pairs")
    for r, y in zip(rows, labels):
        s = "".join("ab"[c] for c in r)
        pairs = sum(s[i:i + 2] in ("ab", "ba") for i in range(len(s) - 1))
        assert y == int(pairs % 2 == 0)


def test_cycle_navigation_matches_dfa():
    _, rows, labels = _sample("cycle_navigation", length=40)
    dfa = automata.cyclic_counter(5, steps=(-1, 0, 1))
    assert labels == [dfa.run(r)[-1] for r in rows]
    assert len(set(labels)) == 5


def test_modular_arithmetic_matches_python_eval():
    task, rows, labels = _sample("modular_arithmetic", length=21)
    assert task.odd_lengths and len(rows[0]) == 21
    for r, y in zip(rows, labels):
        expr = "".join(str(c) if c < 5 else MOD_ARITH_OPS[c - 5] for c in r)
        assert y == eval(expr) % 5, expr  # Python's precedence: * before + and -


def test_modular_arithmetic_even_lengths_become_odd():
    task = get_task("modular_arithmetic")
    for L in range(1, 12):
        tokens, _ = task.batch(2, L, L, _gen(L))
        assert (tokens.shape[1] - 1) % 2 == 1


def _perm_matrix(p):
    n = len(p)
    M = torch.zeros(n, n, dtype=torch.long)
    M[list(p), list(range(n))] = 1  # column i has its one at row p[i]: M(g) M(s) = M(g o s)
    return M


@pytest.mark.parametrize("name,n,alternating", [("s3", 3, False), ("a5", 5, True)])
def test_word_problem_matches_permutation_matrices(name, n, alternating):
    task, rows, labels = _sample(name, batch=32, length=12)
    elements = [p for p in itertools.permutations(range(n))
                if not alternating or torch.det(_perm_matrix(p).double()) > 0]
    assert task.num_symbols == task.num_classes == len(elements) == (6 if n == 3 else 60)
    for r, y in zip(rows, labels):
        prod = torch.eye(n, dtype=torch.long)
        for c in r:
            prod = _perm_matrix(elements[c]) @ prod  # apply the first symbol first
        assert torch.equal(prod, _perm_matrix(elements[y]))


def test_s3_generators_match_symmetric_group_dfa():
    _, rows, labels = _sample("s3_gen", length=30)
    dfa = automata.symmetric_group(3)  # transposition (0 1) and the 3-cycle, as the task's two tokens
    assert labels == [dfa.run(r)[-1] for r in rows]


def test_a5_generators_reach_the_whole_group():
    task = get_task("a5_gen")
    assert task.num_symbols == 2 and task.num_classes == 60
    _, labels = task.batch(4000, 40, 40, _gen(1))
    assert len(set(labels.tolist())) == 60


def test_lengths_and_errors():
    task = get_task("parity")
    g = _gen(3)
    lengths = {task.batch(2, 1, 5, g)[0].shape[1] - 1 for _ in range(100)}
    assert lengths == {1, 2, 3, 4, 5}
    with pytest.raises(ValueError, match="min_len"):
        task.batch(2, 5, 3, g)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("dyck")
    assert set(TASKS) >= {"parity", "even_pairs", "cycle_navigation", "modular_arithmetic", "s3", "a5"}


def test_parity_batch_compat():
    tokens, labels = parity_batch(8, 10, 10, _gen())
    assert tokens.shape == (8, 11) and (tokens[:, 0] == 2).all()
    assert torch.equal(labels, tokens[:, 1:].sum(1) % 2)
