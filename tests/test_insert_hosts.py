"""Shape-level surgery on the real Granite 4.0 / Nemotron-H configurations, built on the meta device."""

import pytest
import torch

from llm_surgery.insert import count_parameters, insert_layers, inserted_layers, inserted_specs, remove_inserted
from llm_surgery.insert.report import markdown, parameter_rows
from llm_surgery.layers.registry import MIXER_KINDS

from host_configs import ATTENTION_LAYERS, GRANITE, NEMOTRON, build_host


@pytest.mark.parametrize("name", GRANITE + NEMOTRON)  # other families: test_any_host.py
def test_real_config_insert_four_of_each_kind(name):
    model = build_host(name, device="meta", dtype=torch.bfloat16)
    attn = ATTENTION_LAYERS[name]
    assert [i for i, t in enumerate(model.config.layers_block_type) if t == "full_attention"] == attn
    hidden = model.config.hidden_size
    host_params = sum(p.numel() for p in model.parameters())
    for kind in MIXER_KINDS:
        insert_layers(model, kind, 4)
        blocks = inserted_layers(model)
        expected = attn if len(attn) == 4 else [attn[0], attn[2], attn[3], attn[5]]  # 4 of 6 spread evenly
        assert sorted(blocks) == expected
        for b in blocks.values():
            assert b.norm.weight.device.type == "meta" and b.norm.weight.dtype == torch.bfloat16
            assert b.mixer.out_proj.weight.shape[0] == hidden
        n_ins, n_total = count_parameters(model)
        assert n_total == host_params + n_ins
        assert 0 < n_ins / n_total < 0.10  # the paper: inserted layers are under 10% of the model
        y = blocks[expected[0]](torch.empty(1, 8, hidden, device="meta", dtype=torch.bfloat16))
        assert y.shape == (1, 8, hidden)
        remove_inserted(model)
        assert not inserted_specs(model) and count_parameters(model) == (0, host_params)


def test_all_attention_blocks_of_12b():
    model = build_host("nemotron-nano-12b-v2", device="meta")
    insert_layers(model, "pdssm", 6)
    assert sorted(inserted_layers(model)) == ATTENTION_LAYERS["nemotron-nano-12b-v2"]


def test_report_table():
    rows = parameter_rows(4, hosts=["granite-4.0-h-350m"])
    table = markdown(rows, 4)
    assert "granite-4.0-h-350m" in table and table.count("\n") == 2
    # kinds are parameter-matched by the registry's defaults: within 5% of each other
    counts = [rows[0][k][0] for k in MIXER_KINDS]
    assert max(counts) / min(counts) < 1.05
    assert rows[0]["pdssm_heads"] == (32, 24, 24) and table.rstrip().endswith("| 32 x 24 |")


def test_report_marks_pdssm_heads_the_fused_op_does_not_serve():
    """Nemotron-H 9B's width 4480 takes 70 pdssm heads of 64 by default (`default_num_heads`), which the fused op
    serves; the paper's 64 heads of 70 it does not: the report says the torch path there, and the layer itself
    refuses backend='kernel' at that size."""
    from llm_surgery.insert.report import heads_cell
    from llm_surgery.layers.flash_pdssm import FlashPDSSM

    heads, state, width = parameter_rows(4, hosts=["nemotron-nano-9b-v2"])[0]["pdssm_heads"]
    assert (heads, state, width) == (70, 64, 64) and heads_cell(heads, state, width) == "70 x 64"
    with torch.device("meta"):
        served = FlashPDSSM(4480, backend="kernel")
        assert (served.num_heads, served.state_size, served.head_dim) == (70, 64, 64)
        with pytest.raises(ValueError, match="serves heads up to state_size and head_dim 64"):
            FlashPDSSM(4480, num_heads=64, backend="kernel")
    assert heads_cell(64, 70, 70) == "64 x 70 (torch path)"
