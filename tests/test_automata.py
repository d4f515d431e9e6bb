"""Proposition 1: one PD layer tracks any DFA exactly, including automata that merge states."""

import pytest
import torch

from llm_surgery import automata

CASES = {
    "parity": automata.parity(),
    "cycle5": automata.cyclic_counter(5),
    "reset6": automata.reset_counter(6),
    "s3": automata.symmetric_group(3),
    "s4": automata.symmetric_group(4),
    "random_merging": automata.DFA(tuple(tuple(int(v) for v in row) for row in
                                         torch.randint(0, 7, (7, 3), generator=torch.Generator().manual_seed(0)))),
}


@pytest.mark.parametrize("name", CASES)
def test_one_hot_state_tracking_over_long_strings(name):
    dfa = CASES[name]
    g = torch.Generator().manual_seed(1)
    symbols = torch.randint(0, dfa.num_symbols, (8, 2000), generator=g)
    truth = torch.tensor([dfa.run(row) for row in symbols.tolist()])
    expected = torch.nn.functional.one_hot(truth, dfa.num_states).double()
    assert torch.equal(automata.track_states(dfa, symbols), expected)
    assert torch.equal(automata.track_states_selected(dfa, symbols[:, :300]), expected[:, :300])


def test_merging_automata_are_not_permutations_and_gather_form_fails():
    dfa = CASES["reset6"]
    P = automata.pd_dictionary(dfa)
    assert len(set(P[1].tolist())) == 1  # reset sends every state to 0
    symbols = torch.tensor([[0, 0, 1, 0]])
    x0 = torch.zeros(1, 6, dtype=torch.float64)
    x0[0, 0] = 1
    # the transposed (gather) update x[i] = x[P[i]] cannot merge: it spreads the state instead
    x = x0.clone()
    for a in symbols[0].tolist():
        x = x[:, P[a]]
    assert x.sum() != 1
    column = automata.track_states(dfa, symbols)[0, -1]
    assert column.tolist() == [0, 1, 0, 0, 0, 0]


def test_dictionary_logits_put_the_margin_at_each_transition():
    """Column q of symbol a's logits holds `margin` at row delta(q, a) and 0 elsewhere (read off the DFA's table, on
    an automaton that merges states, so rows and columns cannot be swapped unnoticed)."""
    dfa = CASES["random_merging"]
    M = automata.dictionary_logits(dfa, margin=2.5)
    expected = torch.zeros(dfa.num_symbols, dfa.num_states, dfa.num_states)
    for q, row in enumerate(dfa.delta):
        for a, target in enumerate(row):
            expected[a, target, q] = 2.5
    assert torch.equal(M, expected)


def test_bad_dfa_is_refused():
    with pytest.raises(ValueError, match="not a state"):
        automata.DFA(((0, 3), (1, 0)))
    with pytest.raises(ValueError, match="transitions"):
        automata.DFA(((0, 1), (1,)))
