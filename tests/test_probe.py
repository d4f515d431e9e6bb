"""llm_surgery.insert.probe.SelectionProbe: what inserted pdssm layers select and how long they remember."""

import math

import pytest
import torch

from llm_surgery.hosts import build_tiny_host
from llm_surgery.insert import insert_layers, inserted_layers
from llm_surgery.insert.probe import SelectionProbe


def _model(**options):
    torch.manual_seed(0)
    return insert_layers(build_tiny_host("granite", seed=1, pattern="M*M*"), "pdssm", 2, **options).eval()


def test_counts_real_tokens_members_and_decays_and_restores_the_mixers():
    model = _model(num_heads=2, state_size=4, dict_size=3, dict_init="identity")
    blocks = inserted_layers(model)
    first = next(iter(blocks.values())).mixer
    with torch.no_grad():
        first.x_proj.weight.zero_()                  # selector logits 0 -> k* = 0 everywhere; decay logits 0
        first.decay_bias.fill_(math.log(2 ** (1 / 3) - 1))    # |D| = sigmoid(-bias) = 2^(-1/3): half-life 3 tokens
    ids = torch.randint(0, model.config.vocab_size, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0                                  # 4 padding tokens: not counted
    with torch.no_grad():
        before = model(ids, attention_mask=mask, use_cache=False).logits
        with SelectionProbe(model) as probe:
            during = model(ids, attention_mask=mask, use_cache=False).logits
        after = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(during, before)       # recording changes nothing
    assert torch.equal(after, before) and first._watchers == []
    s = probe.summary()
    assert set(s) == set(blocks)
    one = s[next(iter(blocks))]
    assert one["tokens"] == 26                        # per head: 30 positions less 4 padded
    assert one["members_used"] == 1 and one["top_member_share"] == 1 and one["entropy_bits"] == 0
    assert one["permutation_share"] == 1 and one["identity_share"] == 1 and one["mean_destinations"] == 4
    assert one["halflife_median_tokens"] == [2.0, 4.0] and one["halflife_64_share"] == 0
    assert one["max_entropy_bits"] == pytest.approx(math.log2(3))
    assert one["surviving_16_tokens"] == 4 and one["surviving_sequence"] == 4   # identities keep every entry


def test_merging_maps_lose_entries():
    """A member that sends every entry to entry 0 leaves one entry after the first step."""
    model = _model(num_heads=2, state_size=4, dict_size=3, dict_init="identity")
    mixer = next(iter(inserted_layers(model).values())).mixer
    with torch.no_grad():
        mixer.x_proj.weight.zero_()
        mixer.dictionary[:, 0] = -10.0
        mixer.dictionary[:, 0, 0, :] = 10.0           # member 0 (selected everywhere): every column's argmax is row 0
    with torch.no_grad(), SelectionProbe(model) as probe:
        model(torch.randint(0, model.config.vocab_size, (2, 20)), use_cache=False)
    one = probe.summary()[next(iter(inserted_layers(model)))]
    assert one["mean_destinations"] == 1 and one["permutation_share"] == 0
    assert one["surviving_16_tokens"] == 1 and one["surviving_sequence"] == 1


def test_refuses_a_model_without_pdssm_layers_and_restores_after_an_error():
    with pytest.raises(ValueError, match="no inserted pdssm layers"):
        SelectionProbe(insert_layers(build_tiny_host("granite", seed=1, pattern="M*"), "mamba2", 1))
    model = _model()
    mixer = next(iter(inserted_layers(model).values())).mixer
    with pytest.raises(RuntimeError, match="boom"), SelectionProbe(model):
        raise RuntimeError("boom")
    assert mixer._watchers == []
