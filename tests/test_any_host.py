"""Any transformers causal-LM family as a host: tiny random hosts of every family in the host table
(`llm_surgery.insert.host.FAMILIES`, sizes in `llm_surgery.hosts.TINY_FAMILIES`), built from configs, with what the
surgery promises checked in each: identity at insertion, a frozen host, save/load, cached generation equal to
uncached with the family's own cache, training with gradient checkpointing, bf16, and the generic rule."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from llm_surgery.hosts import HOST_CONFIGS, TINY_FAMILIES, build_host, build_tiny_family_host, tiny_family_config
from llm_surgery.insert import (count_parameters, insert_layers, inserted_layers, inserted_specs, keep_state_history,
                                load_inserted, remove_inserted, save_inserted)
from llm_surgery.insert.host import FAMILIES, attention_layers
from llm_surgery.insert.state import cache_state

ALL = sorted(TINY_FAMILIES)
#: The families people hold most, dense and hybrid: every promise is checked in each.
MAIN = ["llama", "mistral", "qwen3", "gemma3_text", "granite", "granitemoehybrid", "falcon_h1", "jamba",
        "qwen3_next", "lfm2", "bamba"]
#: Greedy generation of a left-padded batch is checked in these; the other hybrid rows run it as slow tests.
GENERATION = MAIN + ["zamba2", "minimax"] + [pytest.param(f, marks=pytest.mark.slow)
                                             for f in ("nemotron_h", "olmo_hybrid", "qwen3_5_text")]
#: StaticCache, seeded sampling and beam search: a dense host, an every-layer hybrid, Jamba's and a DeltaNet
#: hybrid's caches in the quick run, every other main family as a slow test.
DECODING = ["llama", "falcon_h1", "jamba", "qwen3_next"] + [pytest.param(f, marks=pytest.mark.slow)
                                                            for f in MAIN + ["zamba2", "minimax"]
                                                            if f not in ("llama", "falcon_h1", "jamba", "qwen3_next")]
#: Families where the other mixer kinds are checked (a dense host, an every-layer hybrid, a DeltaNet hybrid).
OTHER_KINDS = [(f, k) for f in ("llama", "falcon_h1", "qwen3_next") for k in ("mamba2", "deltanet")]
#: Families whose transformers cache can crop (hybrids' recurrent cache layers refuse it themselves).
CROPPABLE = ["llama", "qwen3", "granite"]
GEN = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0)  # min: no early EOS
VOCAB = 128


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the inserted mixers' initial weights come from the global generator


def host(model_type, dtype=torch.float32, **overrides):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} not in transformers {transformers.__version__}")
    return build_tiny_family_host(model_type, seed=1, dtype=dtype, **overrides)


def ids(batch=2, length=9, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def perturb(model, seed=0, std=0.5):
    """Non-zero out_proj weights, so that the inserted layers change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in inserted_layers(model).values():
            w = block.mixer.out_proj.weight
            w.copy_((torch.randn(w.shape, generator=g) * std).to(w.dtype))


def surgered(model_type, kind="pdssm", **overrides):
    model = host(model_type, **overrides)
    insert_layers(model, kind, len(attention_layers(model.model)))
    perturb(model)
    return model


def left_padded():
    """Two prompts, the second left-padded with a real token (id 0 would embed to zeros in some hosts and hide a
    missing mask), its 2-D mask, and the second prompt alone."""
    long, short = ids(1, 9, seed=7), ids(1, 6, seed=8)
    batch = torch.cat([long, torch.cat([torch.full((1, 3), 5), short], 1)])
    return batch, (torch.arange(9) >= torch.tensor([[0], [3]])).long(), short


def cache_of(output):
    return output.past_key_values if getattr(output, "past_key_values", None) is not None else output.cache


def cache_kw(model, cache):
    """The model's keyword for a cache: `cache` from transformers 5.24, `past_key_values` before."""
    import inspect
    return {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"): cache}


# ------------------------------------------------------------------------------------------------- the table
def test_every_table_row_has_tiny_sizes():
    assert set(FAMILIES) == set(TINY_FAMILIES)


@pytest.mark.parametrize("model_type", ALL)
def test_insert_is_identity_freezes_host_and_roundtrips(model_type, tmp_path):
    model = host(model_type)
    attn = attention_layers(model.model)
    types = getattr(model.config, "layer_types", None)
    assert attn and (types is None or all(types[i] in ("full_attention", "sliding_attention", "hybrid")
                                          for i in attn))
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    host_keys = set(model.state_dict())
    insert_layers(model, "pdssm", len(attn))
    assert sorted(inserted_layers(model)) == attn
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)  # out_proj starts at zero: exactly the host's function
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".pre_ssm." in n}
    assert host_keys <= set(model.state_dict())

    perturb(model)
    with torch.no_grad():
        changed = model(x).logits
    assert not torch.allclose(changed, ref, atol=1e-3)
    save_inserted(model, tmp_path)
    fresh = load_inserted(host(model_type), tmp_path)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, changed)
    assert all(p.requires_grad == (".pre_ssm." in n) for n, p in fresh.named_parameters())
    other = host(model_type, intermediate_size=96)
    with pytest.raises(ValueError, match="saved from a different host.*intermediate_size: checkpoint 128, model 96"):
        load_inserted(other, tmp_path)
    assert not inserted_specs(other)
    remove_inserted(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)


# ------------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("model_type", GENERATION)
def test_generate_cached_equals_uncached(model_type):
    """A left-padded batch, greedy, with the cache the family's generate makes."""
    model = surgered(model_type)
    batch, mask, short = left_padded()
    with torch.no_grad():  # padding must not reach the inserted layers
        padded = model(batch, attention_mask=mask, use_cache=False).logits[1, 3:]
        torch.testing.assert_close(padded, model(short, use_cache=False).logits[0], rtol=1e-4, atol=1e-4)
    uncached = model.generate(batch, attention_mask=mask, do_sample=False, use_cache=False, **GEN)
    assert torch.equal(model.generate(batch, attention_mask=mask, do_sample=False, **GEN), uncached)


@pytest.mark.parametrize("model_type", DECODING)
def test_static_cache_sampling_and_beams(model_type):
    """The left-padded batch with a StaticCache (generate hands a dense host only 4-D masks then), seeded sampling
    and beam search (the cache's reorder) equal to uncached generation."""
    model = surgered(model_type)
    batch, mask, _ = left_padded()
    uncached = model.generate(batch, attention_mask=mask, do_sample=False, use_cache=False, **GEN)
    static = model.generate(batch, attention_mask=mask, do_sample=False, cache_implementation="static", **GEN)
    assert torch.equal(static, uncached)

    def both(**kw):
        torch.manual_seed(3)
        cached = model.generate(batch[:1], **GEN, **kw)
        torch.manual_seed(3)
        return cached, model.generate(batch[:1], use_cache=False, **GEN, **kw)

    sampled, reference = both(do_sample=True, top_k=0, temperature=2.0, num_return_sequences=3)
    assert torch.equal(sampled, reference)
    beams, reference = both(do_sample=False, num_beams=3, num_return_sequences=3)
    assert torch.equal(beams, reference)


@pytest.mark.parametrize("model_type", MAIN)
def test_decode_with_the_familys_own_cache(model_type):
    """Prefill makes the family's own cache (its hybrid layers, not only attention), then token-by-token decode
    into it equals the full forward; the cache's own layers are left alone."""
    model = surgered(model_type)
    x = ids(2, 9, seed=5)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :6], use_cache=True)
        cache = cache_of(out)
        layer_types = [type(layer).__name__ for layer in getattr(cache, "layers", [])]
        steps = [out.logits] + [model(x[:, t:t + 1], use_cache=True, **cache_kw(model, cache)).logits
                                for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert [type(layer).__name__ for layer in getattr(cache, "layers", [])] == layer_types
    assert type(cache) is type(cache_of(host(model_type)(x[:, :2], use_cache=True)))  # what the host makes
    assert {i: cache_state(cache).latest(i)[0] for i in inserted_layers(model)} == dict.fromkeys(
        inserted_layers(model), 9)


@pytest.mark.parametrize("model_type", CROPPABLE)
def test_cache_crop_and_reset(model_type):
    model = surgered(model_type)
    x = ids(2, 10, seed=9)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = keep_state_history(DynamicCache(config=model.config))
        model(x[:, :6], use_cache=True, **cache_kw(model, cache))
        model(ids(2, 3, seed=10), use_cache=True, **cache_kw(model, cache))  # 3 tokens then cropped away
        cache.crop(-3)
        torch.testing.assert_close(model(x[:, 6:], use_cache=True, **cache_kw(model, cache)).logits, full[:, 6:],
                                   rtol=1e-4, atol=1e-4)
    reference = model.generate(x, do_sample=False, use_cache=False, **GEN)
    static = StaticCache(config=model.config, max_cache_len=16)
    assert torch.equal(model.generate(x, do_sample=False, **GEN, **cache_kw(model, static)), reference)
    static.reset()  # a reset cache starts again from the inserted layers' start state
    assert not cache_state(static).layers
    assert torch.equal(model.generate(x, do_sample=False, **GEN, **cache_kw(model, static)), reference)


# ------------------------------------------------------------------------------------------------ other kinds
@pytest.mark.parametrize("model_type,kind", OTHER_KINDS)
def test_other_kinds(model_type, kind, tmp_path):
    model = host(model_type)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    insert_layers(model, kind, len(attention_layers(model.model)))
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".pre_ssm." not in n)
    perturb(model)
    batch, mask, _ = left_padded()
    assert torch.equal(model.generate(batch, attention_mask=mask, do_sample=False, **GEN),
                       model.generate(batch, attention_mask=mask, do_sample=False, use_cache=False, **GEN))
    save_inserted(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(load_inserted(host(model_type), tmp_path)(x).logits, model(x).logits)


# --------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("model_type", MAIN)
def test_training_with_and_without_checkpointing(model_type):
    model = surgered(model_type, kind="mamba2")
    x = ids(seed=3)
    model.train()

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, plain = grads()
    model.gradient_checkpointing_enable()
    assert all(b.gradient_checkpointing for b in inserted_layers(model).values())
    loss_ckpt, ckpt = grads()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(plain) == set(ckpt) == trainable  # every inserted parameter, nothing of the host
    torch.testing.assert_close(loss_ckpt, loss)
    for n in trainable:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_type", MAIN)
def test_bf16_host(model_type):
    model = host(model_type, dtype=torch.bfloat16)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    insert_layers(model, "pdssm", len(attention_layers(model.model)))
    assert all(p.dtype in (torch.bfloat16, torch.complex64) for b in inserted_layers(model).values()
               for p in b.parameters())
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
    perturb(model)
    model.train()
    model(x, labels=x, use_cache=False).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all()
               for b in inserted_layers(model).values() for p in b.parameters() if not p.is_complex())


# ------------------------------------------------------------------------------------------ real configurations
#: Attention blocks of the real configurations outside Granite 4.0 / Nemotron-H (test_insert_hosts.py), as their
#: config.json files place them.
REAL_ATTENTION = {"llama-3.2-1b": list(range(16)), "qwen3-0.6b": list(range(28)),
                  "qwen3-next-80b-a3b": list(range(3, 48, 4)), "falcon-h1-0.5b": list(range(36)),
                  "jamba-v0.1": [4, 12, 20, 28]}


def test_real_configurations_are_listed():
    assert set(REAL_ATTENTION) <= set(HOST_CONFIGS)


@pytest.mark.parametrize("name", sorted(REAL_ATTENTION))
def test_real_configuration_on_the_meta_device(name):
    if HOST_CONFIGS[name]["model_type"] not in CONFIG_MAPPING:
        pytest.skip(f"{HOST_CONFIGS[name]['model_type']} not in transformers {transformers.__version__}")
    model = build_host(name, device="meta")
    assert attention_layers(model.model) == REAL_ATTENTION[name]
    host_params = sum(p.numel() for p in model.parameters())
    insert_layers(model, "pdssm", 4)
    n_ins, n_total = count_parameters(model)
    assert len(inserted_layers(model)) == 4 and n_total == host_params + n_ins
    assert 0 < n_ins / n_total < 0.10  # the paper: inserted layers are under 10% of the model
    cut = build_host(name, device="meta", num_hidden_layers=8)  # the benchmarks' real width, less depth
    assert attention_layers(cut.model) == [i for i in REAL_ATTENTION[name] if i < 8]


# ---------------------------------------------------------------------------------------------- generic rule
def test_family_outside_the_table_shaped_like_the_others(monkeypatch):
    """The generic rule reads a family the table does not list: decoder layers with `self_attn`, narrowed by
    `config.layer_types` (MiniMax's linear-attention layers also call their mixer `self_attn`)."""
    import llm_surgery.insert.host as host_table

    for model_type, expected in (("llama", [0, 1]), ("minimax", [1])):
        model = host(model_type)
        monkeypatch.delitem(host_table.FAMILIES, model_type)
        assert host_table.family(model).eps == "rms_norm_eps"
        insert_layers(model, "pdssm", len(expected))
        assert sorted(inserted_layers(model)) == expected
        assert count_parameters(model)[0] > 0


def test_unsupported_shapes_are_one_line_errors():
    from transformers import GPT2Config, GPT2LMHeadModel, Mamba2Config, Mamba2ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel \(model_type 'gpt2'.*no `layers` "
                                         r"list of decoder layers; add a row .*FAMILIES") as err:
        insert_layers(gpt2, "pdssm", 1)
    assert "\n" not in str(err.value)
    mamba = Mamba2ForCausalLM(Mamba2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=4,
                                           head_dim=8, state_size=8, n_groups=1))
    with pytest.raises(ValueError, match="none of its 1 decoder layers has a `self_attn` module; add a row"):
        insert_layers(mamba, "pdssm", 1)


def test_tiny_configs_are_the_familys_own():
    config = tiny_family_config("falcon_h1")
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "FalconH1ForCausalLM"
    with pytest.raises(ValueError, match="no tiny sizes for model_type 'gpt2'"):
        tiny_family_config("gpt2")


# ------------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "falcon_h1", "jamba"])
@pytest.mark.parametrize("kind", ["pdssm", "mamba2", "deltanet"])
def test_cuda_matches_cpu_generates_and_trains(model_type, kind):
    from llm_surgery.host_kernels import keep_cpu_convolutions_in_torch

    keep_cpu_convolutions_in_torch()  # with causal-conv1d installed, the hosts' CPU reference needs it
    model = surgered(model_type, kind)
    x = ids(2, 12)
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        model.cuda()
        out = model(x.cuda(), use_cache=False).logits.cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3
    batch, mask, _ = left_padded()
    batch, mask = batch.cuda(), mask.cuda()
    assert torch.equal(model.generate(batch, attention_mask=mask, do_sample=False, **GEN),
                       model.generate(batch, attention_mask=mask, do_sample=False, use_cache=False, **GEN))
    model.train()
    loss = model(x.cuda(), labels=x.cuda(), use_cache=False).loss
    if model_type == "qwen3_next" and _fla_refuses_gated_backward():
        with pytest.raises(RuntimeError, match="Triton >= 3.4.0 and < 3.7.1 on Hopper"):
            loss.backward()  # fla's own guard on the host's gated delta rule (docs/hosts.md)
        return
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for b in inserted_layers(model).values() for p in b.parameters())
    assert all(p.grad is None for n, p in model.named_parameters() if ".pre_ssm." not in n)


def _fla_refuses_gated_backward() -> bool:
    """fla refuses the gated delta rule's backward on Hopper with Triton in [3.4, 3.7.1) unless tilelang is there
    (a wrong-results bug of those Tritons): Qwen3-Next hosts cannot be trained through there."""
    import importlib.util

    import triton

    version = tuple(int(v) for v in triton.__version__.split("+")[0].split(".")[:3])
    return (torch.cuda.get_device_capability()[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)
            and importlib.util.find_spec("tilelang") is None)


def test_cpu_host_runs_where_fla_is_installed(monkeypatch):
    """With fla installed, transformers' Qwen3-Next calls fla's Triton gated delta rule for CPU tensors too (seen on
    a GPU machine: the CPU reference of a qwen3_next host failed); after the surgery's routing a CPU host reaches
    the torch function the decorator wraps."""
    import functools
    import importlib

    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    model = host("qwen3_next")
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        torch_function = getattr(mod, name)
        torch_function = getattr(torch_function, "__wrapped__", torch_function)

        @functools.wraps(torch_function)
        def fla(*args, **kwargs):  # what transformers' decorator calls with fla installed
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

        monkeypatch.setattr(mod, name, fla)
    with pytest.raises(ValueError, match="cpu tensor"), torch.no_grad():
        model(x)
    insert_layers(model, "pdssm", 1)  # routes the hosts' decorated functions
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
        model.generate(x, do_sample=False, **GEN)  # the decode path's recurrent rule too
