"""The mixer registry: kinds, building with defaults and overrides, parameter-matched defaults."""

import pytest
import torch

from llm_surgery.layers.deltanet import DeltaNetMixer
from llm_surgery.layers.mamba2 import Mamba2Mixer
from llm_surgery.layers.registry import (MIXER_KINDS, build_mixer, check_kind, constructor_options, count_params,
                                         default_options, mixer_class, param_table, target_param_count)

WIDTHS = (768, 1024, 1536, 2048, 4096, 4480, 5120)


def test_kinds():
    assert MIXER_KINDS == ("pdssm", "mamba2", "deltanet")


def test_kinds_have_one_home():
    """The trainer's --kind choices are the registry's list, and each kind's class and options come from it."""
    from llm_surgery.train.config import KINDS
    assert KINDS is MIXER_KINDS
    assert [mixer_class(k).__name__ for k in MIXER_KINDS] == ["FlashPDSSM", "Mamba2Mixer", "DeltaNetMixer"]
    assert {"b_gate", "dict_size", "tau"} <= constructor_options("pdssm")
    assert {"n_groups", "state_size"} <= constructor_options("mamba2") and "hidden_size" not in \
        constructor_options("deltanet")


def test_unknown_kind_names_the_allowed_kinds():
    for call in (lambda: build_mixer("mamba3", 64), lambda: default_options("gla", 64),
                 lambda: count_params("lstm", 64), lambda: check_kind(["pdssm"]), lambda: mixer_class(None),
                 lambda: constructor_options("rnn")):
        with pytest.raises(ValueError, match="pdssm, mamba2, deltanet"):
            call()


@pytest.mark.parametrize("bad", [0, -8, 64.0, True, "64"])
def test_bad_width(bad):
    with pytest.raises(ValueError, match="hidden_size"):
        build_mixer("mamba2", bad)


def test_build_uses_defaults_and_overrides():
    m = build_mixer("mamba2", 256)
    assert isinstance(m, Mamba2Mixer) and m.num_heads == default_options("mamba2", 256)["num_heads"]
    d = build_mixer("deltanet", 256, num_heads=2, head_dim=16)
    assert isinstance(d, DeltaNetMixer) and (d.num_heads, d.head_k_dim) == (2, 16)
    x = torch.randn(1, 5, 256)
    for mixer in (m, d):
        assert isinstance(mixer.out_proj, torch.nn.Linear) and mixer(x).shape == x.shape
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        build_mixer("deltanet", 256, no_such_option=1)


def test_default_options_are_copies():
    opts = default_options("mamba2", 1024)
    opts["num_heads"] = 1
    assert default_options("mamba2", 1024)["num_heads"] != 1


def test_count_params_matches_a_real_build():
    """The meta-device count equals a real build's, and the target every kind is matched to is pdssm's real count."""
    for kind in MIXER_KINDS:
        real = sum(p.numel() for p in build_mixer(kind, 384).parameters())
        assert count_params(kind, 384, **default_options(kind, 384)) == real
        if kind == "pdssm":
            assert target_param_count(384) == real


@pytest.mark.parametrize("width", WIDTHS)
def test_parameter_counts_are_matched(width):
    target = target_param_count(width)
    for kind in ("mamba2", "deltanet"):
        n = count_params(kind, width, **default_options(kind, width))
        assert abs(n - target) / target < 0.10, (kind, width, n, target)


def test_param_table_lists_every_width_and_kind():
    table = param_table((768, 2048))
    lines = table.splitlines()
    assert lines[0].startswith("| width | pdssm | mamba2 | deltanet")
    assert len(lines) == 4 and lines[2].startswith("| 768 |") and lines[3].startswith("| 2048 |")
    assert "num_heads=" in lines[2]


def test_build_pdssm():
    m = build_mixer("pdssm", 256)
    assert type(m).__name__ == "FlashPDSSM" and hasattr(m, "out_proj")



@pytest.mark.parametrize("kind", MIXER_KINDS)
def test_attention_mask_must_be_bool_or_zero_one(kind):
    """Every mixer multiplies its inputs by the padding mask, so a 2, 0.5 or -1 would scale a token with no error:
    such masks are refused naming the value; bool, 0/1 integer and 0/1 float masks give the same output."""
    torch.manual_seed(0)
    m = build_mixer(kind, 32)
    x = torch.randn(2, 5, 32)
    ok = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ref = m(x, attention_mask=ok)
    for same in (ok.bool(), ok.float()):
        assert torch.allclose(m(x, attention_mask=same), ref)
    for bad, shown in ((ok * 2, "2"), (ok * 0.5, "0.5"), (-ok, "-1")):
        with pytest.raises(ValueError, match=rf"attention_mask must hold only 0 \(padding\) and 1 .* found {shown}"):
            m(x, attention_mask=bad)


@pytest.mark.parametrize("width", WIDTHS)
def test_defaults_map_onto_the_library_layers(width):
    """The default shapes are ones mamba-ssm's Mamba2 (expand 2, head_dim 64, state 128; the B/C groups match the
    count) and fla's DeltaNet can hold, so on CUDA the library layers run them."""
    with torch.device("meta"):
        m = build_mixer("mamba2", width)
        d = build_mixer("deltanet", width)
    opts = m.library_options()
    assert opts is not None and (opts["expand"], opts["headdim"], opts["d_state"]) == (2, 64, 128)
    assert m.num_heads % m.n_groups == 0
    fla = d.library_options()
    assert round(fla["expand_k"] * width) == d.key_dim and round(fla["expand_v"] * width) == d.value_dim
    assert d.key_dim // fla["num_heads"] == d.head_k_dim
