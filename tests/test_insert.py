"""Surgery on tiny Granite 4.0 and Nemotron-H hosts (real transformers classes, saved with save_pretrained and
reloaded with from_pretrained like a user's checkpoint), for every mixer kind."""

import inspect
import json
from copy import deepcopy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, GPT2LMHeadModel, StaticCache

from llm_surgery.hosts import build_tiny_host
from llm_surgery.insert import (InsertedBlock, count_parameters, insert_layers, inserted_layers, inserted_specs,
                                keep_state_history, load_inserted, remove_inserted, save_inserted, set_tau)
from llm_surgery.insert.state import cache_state
from llm_surgery.layers.registry import MIXER_KINDS

ARCHS = ("granite", "nemotron")
CASES = [(a, k) for a in ARCHS for k in MIXER_KINDS]
# the generation tests: each host and each kind in the quick suite (`-m "not slow"`), every pair in the full one
QUICK = {("granite", "pdssm"), ("nemotron", "mamba2"), ("granite", "deltanet")}
GEN_CASES = [pytest.param(a, k, marks=() if (a, k) in QUICK else pytest.mark.slow) for a, k in CASES]
VOCAB = 128


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the inserted mixers' initial weights come from the global generator


@pytest.fixture(scope="module")
def host_dirs(tmp_path_factory):
    """Each tiny host saved once with save_pretrained (what a user's local checkpoint looks like)."""
    dirs = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(f"host-{arch}")
        build_tiny_host(arch, seed=1).save_pretrained(d)
        dirs[arch] = d
    return dirs


def load_host(host_dirs, arch, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(host_dirs[arch], dtype=dtype).eval()


def perturb(model, seed=0, std=0.2):
    """Give the zero-initialised out_proj weights random values so that inserted layers change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in inserted_layers(model).values():
            w = block.mixer.out_proj.weight
            w.copy_(torch.randn(w.shape, generator=g) * std)


def ids(batch=2, length=10, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def n_attention(model):
    return sum(t == "full_attention" for t in model.config.layers_block_type)


# ------------------------------------------------------------------------------------------- insertion itself
@pytest.mark.parametrize("arch,kind", CASES)
def test_insert_is_identity_and_freezes_host(host_dirs, arch, kind):
    model = load_host(host_dirs, arch)
    host_keys = set(model.state_dict())
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    assert insert_layers(model, kind, n_attention(model)) is model
    with torch.no_grad():
        out = model(x).logits
    assert torch.equal(out, ref)  # out_proj starts at zero: exactly the host's function

    blocks = inserted_layers(model)
    attn = [i for i, t in enumerate(model.config.layers_block_type) if t == "full_attention"]
    assert sorted(blocks) == attn
    assert all(isinstance(b, InsertedBlock) and b.kind == kind for b in blocks.values())
    assert all(torch.count_nonzero(b.mixer.out_proj.weight) == 0 for b in blocks.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".pre_ssm." in n for n in trainable)
    assert trainable == {n for n, _ in model.named_parameters() if ".pre_ssm." in n}
    assert host_keys <= set(model.state_dict())  # host parameter names unchanged
    assert all(k.startswith(tuple(f"model.layers.{i}.pre_ssm." for i in attn))
               for k in set(model.state_dict()) - host_keys)
    n_ins, n_total = count_parameters(model)
    assert n_ins == sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    assert n_total == sum(p.numel() for p in model.parameters()) and n_ins < n_total


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_default_spread_and_explicit(arch):
    model = build_tiny_host(arch, pattern="M*M*M*M*" if arch == "granite" else "M*M-M*E*M*")
    attn = [i for i, t in enumerate(model.config.layers_block_type) if t == "full_attention"]
    assert len(attn) == 4
    insert_layers(model, "mamba2", 2)
    assert [s.attention_position for s in inserted_specs(model)] == [1, 3]
    remove_inserted(model)
    insert_layers(model, "mamba2", 1)
    assert [s.layer_idx for s in inserted_specs(model)] == [attn[2]]
    remove_inserted(model)
    insert_layers(model, ["pdssm", "deltanet", "mamba2"], 3, positions=[3, 0, 2])
    assert [(s.kind, s.attention_position, s.layer_idx) for s in inserted_specs(model)] == [
        ("deltanet", 0, attn[0]), ("mamba2", 2, attn[2]), ("pdssm", 3, attn[3])]


def test_base_model_and_options(host_dirs):
    model = load_host(host_dirs, "granite").model  # GraniteMoeHybridModel, not the CausalLM
    insert_layers(model, "mamba2", 1, positions=[0], state_size=32)
    (block,) = inserted_layers(model).values()
    assert block.mixer.state_size == 32
    assert inserted_specs(model)[0].options["state_size"] == 32
    perturb(model)
    x, mask = ids(), (torch.arange(10) >= torch.tensor([[0], [4]])).long()
    with torch.no_grad():
        by_name = model(input_ids=x, attention_mask=mask).last_hidden_state
        positional = model(x, mask).last_hidden_state  # the padding mask is found in either form
        no_mask = model(x).last_hidden_state
    assert by_name.shape == (2, 10, 64)
    assert torch.equal(by_name, positional)
    assert torch.equal(by_name[0], no_mask[0]) and not torch.allclose(by_name[1, 4:], no_mask[1, 4:])


# ------------------------------------------------------------------------------------------------- training
def _grads(model, x, checkpointing):
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.zero_grad(set_to_none=True)
    loss = model(x, labels=x, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,kind", CASES)
def test_training_backward_with_and_without_checkpointing(host_dirs, arch, kind):
    model = load_host(host_dirs, arch)
    insert_layers(model, kind, n_attention(model))
    x = ids(seed=3)
    # At insertion only out_proj gets a gradient (everything before it is multiplied by zero).
    _, g0 = _grads(model, x, checkpointing=False)
    nonzero = {n for n, g in g0.items() if g.abs().sum() > 0}
    out_proj = {n for n, p in model.named_parameters()
                if p.requires_grad and n.split(".")[-2] in ("out_proj", "o_proj")}
    assert nonzero == out_proj and len(out_proj) == n_attention(model)
    perturb(model)
    loss, g1 = _grads(model, x, checkpointing=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(g1) == trainable  # gradients reach every inserted parameter and nothing else
    loss_ckpt, g2 = _grads(model, x, checkpointing=True)
    assert all(b.gradient_checkpointing for b in inserted_layers(model).values())
    assert torch.allclose(loss, loss_ckpt)
    assert set(g2) == trainable
    for n in trainable:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6), n

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    model(x, labels=x, use_cache=False).loss.backward()
    opt.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) != (n in trainable) for n in before)


def test_checkpointing_enabled_before_insertion(host_dirs):
    model = load_host(host_dirs, "nemotron")
    model.gradient_checkpointing_enable()
    insert_layers(model, "mamba2", 2)
    perturb(model)
    model.train()
    model(ids(), labels=ids(), use_cache=False).loss.backward()
    blocks = inserted_layers(model).values()
    assert all(b.gradient_checkpointing for b in blocks)
    assert all(p.grad is not None for b in blocks for p in b.parameters())


# ----------------------------------------------------------------------------------------------- generation
def trained(host_dirs, arch, kind, steps=2):
    """A host with layers before every attention block, perturbed, then a few real AdamW steps (so every inserted
    tensor is trained and the layers change the tokens generated)."""
    model = load_host(host_dirs, arch) if isinstance(host_dirs, dict) else host_dirs
    insert_layers(model, kind, n_attention(model))
    perturb(model, std=0.5)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(steps):
        x = ids(4, 12, seed=100 + s)
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def cache_kw(model, cache):
    """The model's keyword for a cache: `cache` from transformers 5.24, `past_key_values` before."""
    return {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"): cache}


def attention_only(arch):
    """A tiny host without Mamba layers: the host's own Mamba cache layers refuse crop and batch selection, so
    these cache operations are tested where the inserted layers are the only recurrent state."""
    return build_tiny_host(arch, seed=1, pattern="**")


def decode(model, cache, x, start, stop=None):
    """Logits of feeding x[:, start:stop] token by token into `cache`."""
    out = []
    with torch.no_grad():
        for t in range(start, x.shape[1] if stop is None else stop):
            out.append(model(x[:, t:t + 1], use_cache=True, **cache_kw(model, cache)).logits)
    return torch.cat(out, 1)


GEN = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0)  # min: no early EOS


@pytest.mark.parametrize("arch,kind", CASES)
def test_cached_decode_matches_full_forward(host_dirs, arch, kind):
    model = trained(host_dirs, arch, kind)
    x = ids(batch=2, length=9, seed=5)
    cache = DynamicCache(config=model.config)
    layer_types = [type(layer) for layer in cache.layers]
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        prefill = model(x[:, :6], use_cache=True, **cache_kw(model, cache)).logits
    pieces = torch.cat([prefill, decode(model, cache, x, 6)], 1)
    torch.testing.assert_close(pieces, full, rtol=1e-4, atol=1e-4)
    assert [type(layer) for layer in cache.layers] == layer_types  # the cache's own layers are left alone
    assert sorted(cache_state(cache).layers) == sorted(inserted_layers(model))
    assert all(cache_state(cache).latest(i)[0] == 9 for i in inserted_layers(model))
    # The inserted layers really act: without them the logits differ.
    remove_inserted(model)
    with torch.no_grad():
        assert not torch.allclose(model(x, use_cache=False).logits, full, atol=1e-3)


@pytest.mark.parametrize("arch,kind", GEN_CASES)
def test_generate_cached_equals_uncached(host_dirs, arch, kind):
    """Greedy, seeded sampling, a left-padded batch and beam search (the cache's reorder_cache)."""
    model = trained(host_dirs, arch, kind)
    long, short = ids(1, 9, seed=7), ids(1, 6, seed=8)

    def both(x, seed=0, **kw):
        torch.manual_seed(seed)
        cached = model.generate(x, **GEN, **kw)
        torch.manual_seed(seed)
        return cached, model.generate(x, use_cache=False, **GEN, **kw)

    greedy, uncached = both(long, do_sample=False)
    assert torch.equal(greedy, uncached)
    sampled, uncached = both(long, seed=3, do_sample=True, top_k=0, temperature=2.0, num_return_sequences=3)
    assert torch.equal(sampled, uncached)
    beams, uncached = both(long, do_sample=False, num_beams=3, num_return_sequences=3)
    assert torch.equal(beams, uncached)

    # left padding with a real token (id 0 embeds to zeros in Granite, which would hide a missing mask)
    batch = torch.cat([long, torch.cat([torch.full((1, 3), 5), short], 1)])
    mask = (torch.arange(9) >= torch.tensor([[0], [3]])).long()
    with torch.no_grad():  # padding must not reach the inserted layers' state
        padded = model(batch, attention_mask=mask, use_cache=False).logits[1, 3:]
        torch.testing.assert_close(padded, model(short, use_cache=False).logits[0], rtol=1e-4, atol=1e-4)
    padded_out = model.generate(batch, attention_mask=mask, do_sample=False, **GEN)
    assert torch.equal(padded_out[0], greedy[0])
    assert torch.equal(padded_out[1, 3:], model.generate(short, do_sample=False, **GEN)[0])


@pytest.mark.parametrize("arch,kind", GEN_CASES)
def test_generate_with_static_cache(host_dirs, arch, kind):
    model = trained(host_dirs, arch, kind)
    x = ids(2, 9, seed=2)
    reference = model.generate(x, use_cache=False, do_sample=False, **GEN)
    assert torch.equal(model.generate(x, cache_implementation="static", do_sample=False, **GEN), reference)
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert torch.equal(model.generate(x, do_sample=False, **GEN, **cache_kw(model, cache)), reference)
    cache.reset()  # a reset cache starts again from the inserted layers' start state
    assert not cache_state(cache).layers
    assert torch.equal(model.generate(x, do_sample=False, **GEN, **cache_kw(model, cache)), reference)


@pytest.mark.parametrize("arch,kind", CASES)
def test_cropped_cache(arch, kind):
    model = trained(attention_only(arch), arch, kind)
    x = ids(2, 12, seed=9)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
    # With the history kept, crop goes back exactly to the end of any earlier forward.
    cache = keep_state_history(DynamicCache(config=model.config))
    with torch.no_grad():
        model(x[:, :6], use_cache=True, **cache_kw(model, cache))
    decode(model, cache, ids(2, 4, seed=10), 0)  # 4 tokens that are then cropped away
    cache.crop(-4)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(decode(model, cache, x, 6, 9), full[:, 6:9], rtol=1e-4, atol=1e-4)
    cache.crop(-2)  # back to 7: the end of a one-token forward
    torch.testing.assert_close(decode(model, cache, x, 7), full[:, 7:], rtol=1e-4, atol=1e-4)
    cache.crop(0)  # crop(0) keeps everything
    assert cache.get_seq_length() == 12 and cache_state(cache).latest(inserted_specs(model)[0].layer_idx)[0] == 12
    with pytest.raises(ValueError, match="cropped to 3 tokens.*keeps its recurrent state only after.*6, 7"):
        cache.crop(-9)  # 3 tokens lie inside the 6-token prefill: not restorable

    # Without the history, a crop that removes tokens is an error, and so is using the cache afterwards.
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :8], use_cache=True, **cache_kw(model, cache))
    with pytest.raises(ValueError, match="cropped to 7 tokens.*keep_state_history"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="holds 7 tokens but inserted layer .* covers 8.*reset"):
        decode(model, cache, x, 8, 9)
    cache.crop(-7)  # cropping to 0 goes back to the start state, so the cache is usable again
    with torch.no_grad():
        torch.testing.assert_close(model(x[:, :9], use_cache=True, **cache_kw(model, cache)).logits,
                                   full[:, :9], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_batch_operations_and_copy(arch):
    model = trained(attention_only(arch), arch, "mamba2")
    x = ids(2, 8, seed=11)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :7], use_cache=True, **cache_kw(model, cache))
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    rep = x.repeat_interleave(2, 0)
    with torch.no_grad():
        full = model(rep, use_cache=False).logits
    copy = deepcopy(cache)
    torch.testing.assert_close(decode(model, cache, rep, 7), full[:, 7:], rtol=1e-4, atol=1e-4)
    copy.batch_select_indices(torch.tensor([1, 2]))  # the copy's state follows the copy alone
    assert all(t.shape[0] == 2 for s in cache_state(copy).layers.values() for st in s.values() for t in st)
    assert all(t.shape[0] == 4 for s in cache_state(cache).layers.values() for st in s.values() for t in st)
    torch.testing.assert_close(decode(model, copy, rep[1:3], 7), full[1:3, 7:], rtol=1e-4, atol=1e-4)


def test_cache_filled_without_inserted_layers_is_refused(host_dirs):
    model = load_host(host_dirs, "granite")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids(1, 5), use_cache=True, **cache_kw(model, cache))  # the host alone fills the cache
    insert_layers(model, "deltanet", 1)
    with pytest.raises(ValueError, match="already holds 5 tokens that inserted layer .* did not see"):
        decode(model, cache, ids(1, 6), 5)


@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_generation_state_is_updated_in_place_unless_kept_and_a_failed_step_is_not_continued(kind):
    """The mixers get inplace=True from a cache that keeps no history (its state is their only copy) and False from
    one that does; a forward that fails inside an inserted layer (whose state may then be half-updated) leaves a
    cache that is refused, not continued."""
    model = trained(attention_only("granite"), "granite", kind)
    mixer = next(iter(inserted_layers(model).values())).mixer
    seen = []
    mixer.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("inplace")), with_kwargs=True)
    x = ids(2, 8, seed=12)
    for cache, want in ((DynamicCache(config=model.config), True),
                        (keep_state_history(DynamicCache(config=model.config)), False)):
        seen.clear()
        with torch.no_grad():
            model(x[:, :6], use_cache=True, **cache_kw(model, cache))
        decode(model, cache, x, 6)
        assert seen == [want] * 3

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :6], use_cache=True, **cache_kw(model, cache))

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    mixer.forward = boom
    with pytest.raises(RuntimeError, match="boom"):
        decode(model, cache, x, 6, 7)
    del mixer.forward
    with pytest.raises(ValueError, match="holds 6 tokens that inserted layer .* did not see .*failed"):
        decode(model, cache, x, 6, 7)
    cache.reset()
    if cache.get_seq_length():  # transformers 5.17's reset() zeroes a DynamicCache's tokens but keeps them
        cache = DynamicCache(config=model.config)
    with torch.no_grad():
        torch.testing.assert_close(model(x, use_cache=True, **cache_kw(model, cache)).logits,
                                   model(x, use_cache=False).logits, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ save/load
@pytest.mark.parametrize("arch,kind", CASES)
def test_save_load_roundtrip(host_dirs, tmp_path, arch, kind):
    model = load_host(host_dirs, arch)
    insert_layers(model, kind, 2, positions=[1, 0])
    perturb(model, seed=4)
    with torch.no_grad():
        ref = model(ids()).logits
    save_inserted(model, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "inserted.json").read_text())
    assert meta["host"]["model_type"] == model.config.model_type and meta["host"]["hidden_size"] == 64
    assert [(d["kind"], d["attention_position"]) for d in meta["layers"]] == [(kind, 0), (kind, 1)]
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "ckpt" / "inserted.safetensors")
    assert sum(t.numel() for t in saved.values()) == count_parameters(model)[0]

    fresh = load_host(host_dirs, arch)
    load_inserted(fresh, tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(fresh(ids()).logits, ref)
    assert [s.layer_idx for s in inserted_specs(fresh)] == [s.layer_idx for s in inserted_specs(model)]
    assert all(p.requires_grad == (".pre_ssm." in n) for n, p in fresh.named_parameters())


def test_deltanet_checkpoint_with_the_old_projection_name_loads(host_dirs, tmp_path):
    """DeltaNet's final projection took fla's name `o_proj`; checkpoints that call it `out_proj` still load."""
    from safetensors.torch import load_file, save_file
    model = insert_layers(load_host(host_dirs, "granite"), "deltanet", 1)
    perturb(model)
    save_inserted(model, tmp_path)
    weights = tmp_path / "inserted.safetensors"
    old = {k.replace(".mixer.o_proj.", ".mixer.out_proj."): v for k, v in load_file(weights).items()}
    assert any(".mixer.out_proj." in k for k in old)
    save_file(old, weights)
    fresh = load_inserted(load_host(host_dirs, "granite"), tmp_path)
    with torch.no_grad():
        assert torch.equal(fresh(ids()).logits, model(ids()).logits)


def test_format_1_checkpoint_loads_and_keeps_the_heads_it_was_built_with(host_dirs, tmp_path):
    """Format 1 took sqrt(D) power-of-two pdssm heads at every width; from width 4097 on the default now gives more,
    narrower heads (`default_num_heads`). A format-1 checkpoint still loads as built: at the tiny width unchanged,
    and at Nemotron-H 9B's 4480 its layers name the 64 heads of 70 it was built with."""
    from llm_surgery.insert import read_inserted_config
    from llm_surgery.layers.flash_pdssm import FlashPDSSM

    model = insert_layers(load_host(host_dirs, "granite"), "pdssm", 1)
    perturb(model)
    save_inserted(model, tmp_path / "v2")
    assert json.loads((tmp_path / "v2" / "inserted.json").read_text())["format_version"] == 2
    v1 = _rewrite(tmp_path / "v2", tmp_path / "v1", lambda m: m.update(format_version=1))
    fresh = load_inserted(load_host(host_dirs, "granite"), v1)
    with torch.no_grad():
        assert torch.equal(fresh(ids()).logits, model(ids()).logits)

    wide = _rewrite(tmp_path / "v2", tmp_path / "v1_4480", lambda m: (m.update(format_version=1),
                                                                       m["host"].update(hidden_size=4480)))
    options = read_inserted_config(wide)["layers"][0].options
    with torch.device("meta"):
        assert (FlashPDSSM(4480, **options).num_heads, FlashPDSSM(4480).num_heads) == (64, 70)
    (wide / "inserted.json").write_text((wide / "inserted.json").read_text().replace('"format_version": 1',
                                                                                       '"format_version": 3'))
    with pytest.raises(ValueError, match="format_version 3 is not 1 or 2"):
        read_inserted_config(wide)


def test_mixed_kinds_roundtrip_into_bf16_host(host_dirs, tmp_path):
    model = load_host(host_dirs, "nemotron")
    insert_layers(model, ["pdssm", "mamba2"], 2)
    perturb(model)
    save_inserted(model, tmp_path)
    fresh = load_host(host_dirs, "nemotron", dtype=torch.bfloat16)
    load_inserted(fresh, tmp_path)
    assert [b.kind for b in inserted_layers(fresh).values()] == ["pdssm", "mamba2"]
    for b in inserted_layers(fresh).values():
        assert all(p.dtype in (torch.bfloat16, torch.complex64) for p in b.parameters())
        torch.testing.assert_close(b.mixer.out_proj.weight.float(),
                                   inserted_layers(model)[b.layer_idx].mixer.out_proj.weight, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_host(host_dirs, arch):
    model = load_host(host_dirs, arch, dtype=torch.bfloat16)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    insert_layers(model, ["pdssm", "deltanet"] if arch == "granite" else ["mamba2", "pdssm"], 2)
    for b in inserted_layers(model).values():
        assert b.norm.weight.dtype == torch.bfloat16
        assert all(p.dtype in (torch.bfloat16, torch.complex64) for p in b.parameters())
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
    perturb(model)
    model.train()
    model(x, labels=x, use_cache=False).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all()
               for b in inserted_layers(model).values() for p in b.parameters() if not p.is_complex())
    model.eval()
    out = model.generate(ids(1, 6), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)


# ----------------------------------------------------------------------------------------------- helpers
def test_set_tau_and_count(host_dirs):
    model = load_host(host_dirs, "granite")
    insert_layers(model, ["pdssm", "mamba2"], 2)
    assert set_tau(model, 0.25) == 1
    kinds = {b.kind: b for b in inserted_layers(model).values()}
    assert kinds["pdssm"].mixer.tau == 0.25
    with pytest.raises(ValueError, match="tau"):
        set_tau(model, 0.0)
    n_ins, n_total = count_parameters(model)
    assert n_ins == sum(p.numel() for b in kinds.values() for p in b.parameters())


# ------------------------------------------------------------------------------------------------- errors
def test_errors_on_bad_arguments(host_dirs):
    model = load_host(host_dirs, "granite")  # 2 attention blocks
    with pytest.raises(ValueError, match="unknown mixer kind 'lstm'.*pdssm"):
        insert_layers(model, "lstm", 1)
    with pytest.raises(ValueError, match="between 1 and 2"):
        insert_layers(model, "mamba2", 3)
    with pytest.raises(ValueError, match="between 1 and 2"):
        insert_layers(model, "mamba2", 0)
    with pytest.raises(ValueError, match="0..1"):
        insert_layers(model, "mamba2", 1, positions=[2])
    with pytest.raises(ValueError, match="0..1"):
        insert_layers(model, "mamba2", 1, positions=[-1])
    with pytest.raises(ValueError, match="duplicate"):
        insert_layers(model, "mamba2", 2, positions=[1, 1])
    with pytest.raises(ValueError, match="exactly n positions"):
        insert_layers(model, "mamba2", 2, positions=[1])
    with pytest.raises(ValueError, match="exactly n kinds"):
        insert_layers(model, ["mamba2"], 2)
    assert not inserted_layers(model) and all(p.requires_grad for p in model.parameters())  # untouched
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2))  # no `layers` list
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*add a row"):
        insert_layers(gpt2, "mamba2", 1)
    with pytest.raises(TypeError, match="transformers model"):
        insert_layers(torch.nn.Linear(2, 2), "mamba2", 1)
    insert_layers(model, "mamba2", 1)
    with pytest.raises(ValueError, match="already has 1 inserted"):
        insert_layers(model, "deltanet", 1)


def test_checkpoint_errors(host_dirs, tmp_path):
    with pytest.raises(ValueError, match="no inserted layers"):
        save_inserted(load_host(host_dirs, "granite"), tmp_path / "none")
    with pytest.raises(ValueError, match="no inserted-layer checkpoint: .*inserted.json does not exist"):
        load_inserted(load_host(host_dirs, "granite"), tmp_path / "missing")

    model = load_host(host_dirs, "granite")
    insert_layers(model, "deltanet", 2)
    ckpt = save_inserted(model, tmp_path / "ok")

    with pytest.raises(ValueError, match="different host.*model_type"):
        load_inserted(load_host(host_dirs, "nemotron"), ckpt)
    with pytest.raises(ValueError, match="different host.*hidden_size: checkpoint 64, model 96"):
        load_inserted(build_tiny_host("granite", hidden_size=96), ckpt)
    with pytest.raises(ValueError, match="different host.*num_hidden_layers"):
        load_inserted(build_tiny_host("granite", pattern="M*M*M"), ckpt)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "inserted.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt.*inserted.json"):
        load_inserted(load_host(host_dirs, "granite"), bad)
    (bad / "inserted.json").write_text((ckpt / "inserted.json").read_text())
    with pytest.raises(ValueError, match="no inserted-layer weights: .*inserted.safetensors does not exist"):
        load_inserted(load_host(host_dirs, "granite"), bad)
    (bad / "inserted.safetensors").write_bytes((ckpt / "inserted.safetensors").read_bytes()[:100])
    fresh = load_host(host_dirs, "granite")
    with pytest.raises(ValueError, match="cannot read.*inserted.safetensors"):
        load_inserted(fresh, bad)
    assert not inserted_layers(fresh)

    # Weights that do not fit the recorded layers: strict, and the host is left as it was.
    meta = json.loads((ckpt / "inserted.json").read_text())
    meta["layers"][0]["kind"] = "mamba2"
    meta["layers"][0]["options"] = {}
    (bad / "inserted.json").write_text(json.dumps(meta))
    (bad / "inserted.safetensors").write_bytes((ckpt / "inserted.safetensors").read_bytes())
    with pytest.raises(ValueError, match="inserted.safetensors does not match inserted layer"):
        load_inserted(fresh, bad)
    assert not inserted_layers(fresh) and not any(".pre_ssm." in n for n, _ in fresh.named_parameters())


# ------------------------------------------------------------------------------------- transactional surgery
def snapshot(model):
    """Everything the surgery may touch: modules, their attributes and hooks, and requires_grad flags."""
    return ({n: p.requires_grad for n, p in model.named_parameters()},
            {n: (sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks))
             for n, m in model.named_modules()})


def test_failed_insert_leaves_model_as_it_was(host_dirs, monkeypatch):
    model = load_host(host_dirs, "nemotron")
    before = snapshot(model)
    with pytest.raises(TypeError, match="dict_size"):  # a pdssm option that mamba2 does not take
        insert_layers(model, ["pdssm", "mamba2"], 2, dict_size=4)
    assert snapshot(model) == before
    # An error while attaching (here: the last hook) puts back what was already attached.
    calls = []

    def failing_hook(self, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("hook refused")

    monkeypatch.setattr(type(model.model), "register_forward_hook", failing_hook)
    with pytest.raises(RuntimeError, match="hook refused"):
        insert_layers(model, ["pdssm", "mamba2"], 2)
    assert calls and snapshot(model) == before
    monkeypatch.undo()
    # A retry works, and each block runs once per forward.
    insert_layers(model, ["pdssm", "mamba2"], 2)
    runs = []
    for block in inserted_layers(model).values():
        block.register_forward_hook(lambda *a: runs.append(1))
    with torch.no_grad():
        model(ids(), use_cache=False)
    assert len(runs) == 2
    remove_inserted(model)
    assert snapshot(model)[1] == before[1]  # remove_inserted puts back every attribute and hook
    model.model.layers[1].pre_ssm = torch.nn.Identity()  # something of the user's under the name the surgery uses
    with pytest.raises(ValueError, match=r"decoder layers \[1\] already have a 'pre_ssm' attribute"):
        insert_layers(model, "mamba2", 1, positions=[0])


def _rewrite(src, dst, edit):
    dst.mkdir()
    meta = json.loads((src / "inserted.json").read_text())
    edit(meta)
    (dst / "inserted.json").write_text(json.dumps(meta))
    (dst / "inserted.safetensors").write_bytes((src / "inserted.safetensors").read_bytes())
    return dst


def test_load_inserted_checks_layers_and_host_config_before_touching_the_model(host_dirs, tmp_path):
    model = load_host(host_dirs, "granite")  # attention blocks at decoder layers 1 and 3
    insert_layers(model, "mamba2", 2)
    perturb(model)
    ckpt = save_inserted(model, tmp_path / "ok")
    meta = json.loads((ckpt / "inserted.json").read_text())
    assert meta["host"]["name_or_path"] == str(host_dirs["granite"]) and len(meta["host"]["config_hash"]) == 64
    assert meta["host"]["config"]["hidden_size"] == 64

    def set_idx(i, j):
        def edit(m):
            m["layers"][0]["layer_idx"], m["layers"][1]["layer_idx"] = i, j
        return edit

    fresh = load_host(host_dirs, "granite")
    before = snapshot(fresh)
    for name, edit, match in [
            ("range", set_idx(1, 7), "layer_idx 7 is out of range: this host has 4 decoder layers"),
            ("twice", set_idx(1, 1), "layer_idx 1 appears twice"),
            ("mamba", set_idx(0, 3), "layer_idx 0 with attention_position 0 does not name an attention block")]:
        with pytest.raises(ValueError, match=match):
            load_inserted(fresh, _rewrite(ckpt, tmp_path / name, edit))
        assert snapshot(fresh) == before
    # weights that do not fit: checked before anything is attached (flags included)
    with pytest.raises(ValueError, match="does not match inserted layer"):
        load_inserted(fresh, _rewrite(ckpt, tmp_path / "kind", lambda m: m["layers"][1].update(
            kind="deltanet", options={})))
    assert snapshot(fresh) == before

    # A host of another config (same shapes) is refused with the fields that differ.
    other = build_tiny_host("granite", seed=1, embedding_multiplier=6.0, rms_norm_eps=1e-6)
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"different host \(.*host-granite.*\): embedding_multiplier: checkpoint "
                                         r"12.0, model 6.0; rms_norm_eps: checkpoint 1e-05, model 1e-06"):
        load_inserted(other, ckpt)
    assert snapshot(other) == before
    # the dtype, the path and fields only one transformers release has are not differences
    load_inserted(load_host(host_dirs, "granite", dtype=torch.bfloat16), ckpt)
    load_inserted(build_tiny_host("granite", seed=1), _rewrite(ckpt, tmp_path / "newer", lambda m: (
        m["host"]["config"].update(field_of_a_newer_release=1), m["host"].update(config_hash="0" * 64))))
    # a checkpoint written before the hash was recorded still loads
    old = _rewrite(ckpt, tmp_path / "old", lambda m: [m["host"].pop(k) for k in ("name_or_path", "config_hash",
                                                                                 "config")])
    fresh = load_inserted(load_host(host_dirs, "granite"), old)
    with torch.no_grad():
        assert torch.equal(fresh(ids()).logits, model(ids()).logits)


# ------------------------------------------------------------------------------------------ Accelerate (DDP)
DDP_SCRIPT = r'''
import sys, torch
from accelerate import Accelerator
from llm_surgery.hosts import build_tiny_host
from llm_surgery.insert import insert_layers, inserted_layers, load_inserted, save_inserted

acc = Accelerator(cpu=True)
assert acc.num_processes == 2 and acc.distributed_type.name == "MULTI_CPU", acc.distributed_type
for arch in ("granite", "nemotron"):
    torch.manual_seed(0)
    model = build_tiny_host(arch, seed=1)
    insert_layers(model, ["pdssm", "deltanet"] if arch == "granite" else ["mamba2", "pdssm"], 2)
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    assert type(model).__name__ == "DistributedDataParallel"
    model.train()
    g = torch.Generator().manual_seed(100 + acc.process_index)  # different data on each rank
    for _ in range(2):
        x = torch.randint(3, 128, (2, 12), generator=g)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    inner = acc.unwrap_model(model)
    assert sorted(n for n, p in inner.named_parameters() if p.requires_grad) == names  # stable names
    flat = torch.cat([p.detach().flatten().real for n, p in inner.named_parameters() if p.requires_grad])
    both = acc.gather(flat[None])
    assert torch.equal(both[0], both[1]), "ranks diverged"
    assert any(b.mixer.out_proj.weight.abs().sum() > 0 for b in inserted_layers(inner).values())
    if acc.is_main_process:
        save_inserted(inner, sys.argv[1] + arch)
    acc.wait_for_everyone()
    fresh = load_inserted(build_tiny_host(arch, seed=1), sys.argv[1] + arch)
    for i, b in inserted_layers(fresh).items():
        for (n, p), q in zip(b.named_parameters(), inserted_layers(inner)[i].parameters()):
            assert torch.equal(p, q), n
print("DDP-OK", acc.process_index)
'''


@pytest.mark.slow
def test_accelerate_ddp_two_processes(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "ddp_insert.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(29500 + (os.getpid() % 1000)), str(script), str(tmp_path / "ckpt")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("DDP-OK") == 2


# ------------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch,kind", CASES)
def test_cuda_matches_cpu_and_generates(arch, kind):
    from llm_surgery.host_kernels import keep_cpu_convolutions_in_torch

    keep_cpu_convolutions_in_torch()  # with causal-conv1d installed, the hosts' CPU reference needs it
    model = build_tiny_host(arch, seed=1)
    insert_layers(model, kind, n_attention(model))
    perturb(model)
    x = ids(2, 12)
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        model.cuda()
        assert all(p.is_cuda for b in inserted_layers(model).values() for p in b.parameters())
        out = model(x.cuda(), use_cache=False).logits.cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(x[:1].cuda(), **kw), model.generate(x[:1].cuda(), use_cache=False, **kw))
    model.train()
    model(x.cuda(), labels=x.cuda(), use_cache=False).loss.backward()
    assert all(p.grad is not None for b in inserted_layers(model).values() for p in b.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_mask_is_checked_once_per_forward_and_bad_values_refused(host_dirs, arch, monkeypatch):
    """The model's 2-D mask reaches every inserted mixer as bool after one value check (not one per layer);
    a mask holding anything but 0/1 is a clear error before any inserted layer runs."""
    import llm_surgery.insert.surgery as surgery_module

    model = insert_layers(load_host(host_dirs, arch), "pdssm", n=2)
    x, mask = ids(), torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    calls = []
    real_check = surgery_module.check_mask_values
    monkeypatch.setattr(surgery_module, "check_mask_values", lambda *a: calls.append(1) or real_check(*a))
    seen = []
    for block in inserted_layers(model).values():
        block.mixer.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("attention_mask")), with_kwargs=True)
    model(x, attention_mask=mask)
    assert len(calls) == 1 and len(seen) == 2
    assert all(m.dtype == torch.bool and torch.equal(m, mask.bool()) for m in seen)
    mask[1, 4] = 2
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        model(x, attention_mask=mask)


def _train(model, device, steps):
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(steps):
        x = ids(4, 12, seed=100 + s).to(device)
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mamba2", "deltanet"])
def test_cuda_trained_layers_move_to_cpu_and_back(tmp_path, kind):
    """Layers trained in bf16 on the GPU (mamba-ssm's / fla's layers) load, decode and keep training on the CPU
    (the torch path) and back again: one state dict, the same function within bf16 tolerance."""
    from llm_surgery.host_kernels import keep_cpu_convolutions_in_torch

    keep_cpu_convolutions_in_torch()  # with causal-conv1d installed, the host's CPU reference needs it
    build_tiny_host("granite", seed=1).save_pretrained(tmp_path / "host")
    hosts = {"granite": tmp_path / "host"}
    gpu = insert_layers(load_host(hosts, "granite", torch.bfloat16).cuda(), kind, 2)
    perturb(gpu, std=0.5)
    _train(gpu, "cuda", 2)
    x = ids(2, 12)
    with torch.no_grad():
        ref = gpu(x.cuda(), use_cache=False).logits
    save_inserted(gpu, tmp_path / "gpu")

    cpu = load_inserted(load_host(hosts, "granite"), tmp_path / "gpu")
    with torch.no_grad():
        out = cpu(x, use_cache=False).logits
    assert _rel(out, ref) < 5e-2
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(cpu.generate(x[:1], **kw), cpu.generate(x[:1], use_cache=False, **kw))
    _train(cpu, "cpu", 1)
    with torch.no_grad():
        out = cpu(x, use_cache=False).logits
    save_inserted(cpu, tmp_path / "cpu")

    back = load_inserted(load_host(hosts, "granite", torch.bfloat16), tmp_path / "cpu").cuda()
    xg = x.cuda()
    with torch.no_grad():
        full = back(xg, use_cache=False).logits
        cache = DynamicCache(config=back.config)
        prefill = back(xg[:, :8], use_cache=True, **cache_kw(back, cache)).logits
        pieces = torch.cat([prefill, decode(back, cache, xg, 8)], 1)
    assert _rel(full, out) < 5e-2 and _rel(pieces, full) < 3e-2
    _train(back, "cuda", 1)
    assert all(torch.isfinite(p).all() for b in inserted_layers(back).values() for p in b.parameters())


def test_inserted_pdssm_dictionaries_start_as_identities_unless_asked_otherwise():
    """INSERTED_DEFAULTS: an inserted Flash PD-SSM begins exactly as a diagonal SSM: every member of every head is
    the identity at any state size (the margin is over each column's largest random logit); an explicit dict_init
    wins (PD-SSM's random maps: about 1 column in N is its own entry)."""
    for options, lowest, highest in (({}, 1.0, 1.0), ({"state_size": 32}, 1.0, 1.0),
                                     ({"dict_init": "normal"}, 0.0, 0.5)):
        torch.manual_seed(0)
        model = insert_layers(build_tiny_host("granite", seed=1, pattern="M*M*"), "pdssm", 2, **options)
        for block in inserted_layers(model).values():
            P = block.mixer.transitions().long()
            assert lowest <= float((P == torch.arange(P.shape[-1])).double().mean()) <= highest
        assert {s.options["dict_init"] for s in inserted_specs(model)} == {options.get("dict_init", "identity")}
