"""group_image: which homomorphic image of the group each Flash PD-SSM head's token maps realise."""

import pytest
import torch

from llm_surgery.bench.state_tracking import group_image
from llm_surgery.bench.state_tracking.protocol import config
from llm_surgery.bench.state_tracking.tasks import get_task, group_word_problem, permutation_group
from llm_surgery.bench.state_tracking.train import build_model


def _sign(p):
    return (-1) ** sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p)))


def test_faithful_sign_trivial_and_inconsistent_heads_of_the_symmetric_group():
    _, elements, table = group_word_problem("s3")
    perms = permutation_group(3)
    faithful = torch.tensor([perms[e] for e in elements])                      # each token its own permutation
    sign = torch.tensor([(1, 0, 2) if _sign(perms[e]) < 0 else (0, 1, 2) for e in elements])
    trivial = torch.tensor([(0, 1, 2)] * len(elements))
    wrong = trivial.clone()
    wrong[perms.index((1, 0, 2))] = torch.tensor((1, 2, 0))                   # a transposition as a 3-cycle
    assert group_image.head_image(faithful, elements, table) == 6
    assert group_image.head_image(sign, elements, table) == 2
    assert group_image.head_image(trivial, elements, table) == 1
    assert group_image.head_image(wrong, elements, table) is None             # (0 1)(0 1) = e, but 3-cycle^2 != id


def test_natural_agreement_counts_tokens_under_the_best_relabelling():
    task = get_task("s3")
    perms, elements, table = group_word_problem(task.name)
    faithful = torch.tensor([perms[e] for e in elements])
    sigma = [2, 0, 1]                                            # entry sigma[i] holds point i
    relabelled = torch.tensor([[sigma[perms[e][sigma.index(j)]] for j in range(3)] for e in elements])
    assert not torch.equal(relabelled, faithful)
    assert group_image.natural_agreement(relabelled, elements, perms) == 6
    near = faithful.clone()
    near[4] = near[5]                                            # one token shares another's member
    assert group_image.natural_agreement(near, elements, perms) == 5
    assert group_image.head_image(near, elements, table) is None
    assert group_image.natural_agreement(torch.zeros(6, 4, dtype=torch.long), elements, perms) is None   # N != 3


def test_a5_generators_faithful_only_as_themselves():
    task = get_task("a5_gen")
    _, elements, table = group_word_problem(task.name)
    perms = permutation_group(5, alternating=True)
    P = torch.tensor([perms[e] for e in elements])
    assert group_image.head_image(P, elements, table) == 60
    swapped = P[[1, 0]]   # a 3-cycle for the 5-cycle and back: not a homomorphism (orders 3 and 5 differ)
    assert group_image.head_image(swapped, elements, table) is None


def test_token_transitions_are_what_the_layer_selects_in_a_sequence():
    task = get_task("s3")
    model = build_model(config("pdssm", "s3", 0, 2e-3, device="cpu")).eval()
    mixer = model.blocks[0].mixer
    P_tok = group_image.token_transitions(model, task)                         # [H, S, N]
    assert P_tok.shape == (mixer.num_heads, task.num_symbols, mixer.state_size)
    tokens = torch.randint(0, task.num_symbols, (2, 17), generator=torch.Generator().manual_seed(0))
    seen = {}
    with mixer.watching_inputs(lambda u, m: seen.setdefault("k", mixer._ssm_inputs(u)[0].argmax(-1))), \
            torch.no_grad():
        model(tokens)
    P_seq = torch.gather(mixer.transitions().long()[None].expand(2, -1, -1, -1), 2,
                         seen["k"][..., None].expand(-1, -1, -1, mixer.state_size).long())   # [B, H, L, N]
    assert torch.equal(P_seq, P_tok[:, tokens].permute(1, 0, 2, 3))
    s = group_image.summary(model, task)
    assert len(s["images"]) == mixer.num_heads and s["group_order"] == 6 and s["symbols"] == 6
    assert s["closest"] == max(s["natural_tokens"]) and 0 <= s["closest"] <= 6


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="not a group word problem"):
        group_word_problem("parity")
    model = build_model(config("pdssm", "parity", 0, 2e-3, device="cpu"))       # Table 1's preset: conv_kernel 1
    model.blocks[0].mixer.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4)
    with pytest.raises(ValueError, match="conv_kernel=1"):
        group_image.token_transitions(model, get_task("s3"))
