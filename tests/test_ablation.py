"""llm_surgery.insert.ablation.tokens_alone: inserted mixers without memory, for measuring what their memory adds."""

import pytest
import torch

from llm_surgery.hosts import build_tiny_host
from llm_surgery.insert import insert_layers, inserted_layers
from llm_surgery.insert.ablation import tokens_alone


@pytest.mark.parametrize("kind", ["pdssm", "mamba2", "deltanet"])
def test_each_token_passes_the_inserted_mixers_alone_and_the_model_is_restored(kind, monkeypatch):
    from llm_surgery.insert import ablation
    monkeypatch.setattr(ablation, "MAX_SEQUENCES", 5)  # the 18 one-token sequences go through in 4 calls
    torch.manual_seed(0)
    model = insert_layers(build_tiny_host("granite", seed=1, pattern="M*M*"), kind, 2).eval()
    with torch.no_grad():  # as if trained: inserted layers start as the identity (zero output projection)
        for block in inserted_layers(model).values():
            for p in block.parameters():
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mixer = next(iter(inserted_layers(model).values())).mixer
    x = torch.randn(2, 9, model.config.hidden_size)
    with torch.no_grad():
        before_logits, before_mixer = model(ids, use_cache=False).logits, mixer(x)
        with tokens_alone(model):
            alone_logits, alone_mixer = model(ids, use_cache=False).logits, mixer(x)
            with pytest.raises(ValueError, match="use_cache=False"):
                mixer(x, return_state=True)
        after_logits = model(ids, use_cache=False).logits
    each = torch.cat([mixer(x[:, t:t + 1]) for t in range(9)], 1)  # every token as its own sequence
    torch.testing.assert_close(alone_mixer, each)
    torch.testing.assert_close(alone_mixer[:, 0], before_mixer[:, 0])  # the first token has nothing to remember
    assert not torch.allclose(alone_mixer[:, 1:], before_mixer[:, 1:], atol=1e-6)  # the others lose their past
    assert not torch.allclose(alone_logits, before_logits)
    assert torch.equal(after_logits, before_logits)  # the normal forward is back


def test_refuses_a_model_without_inserted_layers_and_restores_after_an_error():
    with pytest.raises(ValueError, match="no inserted layers"):
        with tokens_alone(build_tiny_host("granite", seed=1, pattern="M*")):
            pass
    model = insert_layers(build_tiny_host("granite", seed=1, pattern="M*"), "pdssm", 1)
    mixer = next(iter(inserted_layers(model).values())).mixer
    with pytest.raises(RuntimeError, match="boom"):
        with tokens_alone(model):
            raise RuntimeError("boom")
    assert "forward" not in vars(mixer)  # the class's forward again
