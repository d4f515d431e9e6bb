"""A surgered model under Hugging Face's `Trainer` and TRL's `SFTTrainer`, with no subclass and no callback: every
`checkpoint-N/` and `save_model` directory holds the inserted layers (`load_inserted` restores them into a fresh
host), `resume_from_checkpoint` continues exactly, and `save_pretrained` never writes a directory that
`from_pretrained` would load without the layers."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm_surgery.insert import insert_layers, inserted_layers, load_inserted, remove_inserted

sys.path.insert(0, str(Path(__file__).parent))
from own_data_host import save_tiny_checkpoint, word_tokenizer  # noqa: E402

PAIRS = [(a, b) for a in "abcdef" for b in "0123"]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("host") / "tiny")


def surgered(host, seed=0):
    torch.manual_seed(seed)  # the inserted layers' initial weights
    return insert_layers(AutoModelForCausalLM.from_pretrained(host), "pdssm", 2)


def layer_tensors(model) -> dict:
    return {f"{i}.{k}": v.detach().clone() for i, b in inserted_layers(model).items()
            for k, v in b.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def ids(n=2, length=9):
    return torch.randint(3, len(word_tokenizer()), (n, length), generator=torch.Generator().manual_seed(0))


def test_save_pretrained_writes_the_layers_never_a_host_from_pretrained_would_load_without_them(host, tmp_path):
    model = surgered(host)
    with torch.no_grad():
        for b in inserted_layers(model).values():
            b.mixer.out_proj.weight.normal_(0, 0.3)  # the layers now change the output
    want = model(ids()).logits
    for who in (model, model.model):  # the model and its decoder stack
        who.save_pretrained(tmp_path / "saved")
        assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
            "inserted.json", "inserted.safetensors", "model.safetensors"]
        with pytest.raises((OSError, ValueError), match="config.json"):  # no config.json: from_pretrained fails, never drops the layers
            AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        fresh = load_inserted(AutoModelForCausalLM.from_pretrained(host), tmp_path / "saved")
        assert torch.allclose(fresh(ids()).logits, want, atol=1e-6)

    model.save_pretrained(tmp_path / "full", host_weights=True)  # the host only when asked, in host/
    assert not (tmp_path / "full" / "config.json").exists() and (tmp_path / "full" / "host" / "config.json").is_file()
    back = load_inserted(AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "host"), tmp_path / "full")
    assert torch.allclose(back(ids()).logits, want, atol=1e-6)
    assert not any("pre_ssm" in k for k in AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "host")
                   .state_dict())
    model.save_pretrained(tmp_path / "other", is_main_process=False)  # another rank of a launch writes nothing
    assert not (tmp_path / "other").exists()
    remove_inserted(model).save_pretrained(tmp_path / "plain")  # the host alone saves as any model
    assert (tmp_path / "plain" / "config.json").is_file()


def _dataset(tok):
    enc = [tok(f"{a} {b} -> {b} {a}") for a, b in PAIRS]

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(enc)

        def __getitem__(self, i):
            return dict(enc[i])
    return Pairs()


def _trainer(model, tok, out, max_steps):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, use_cpu=True, report_to=[], logging_steps=1, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_dataset(tok),
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False))


@pytest.mark.slow
def test_trainer_checkpoints_resume_and_load_inserted_restores_each(host, tmp_path):
    tok = word_tokenizer()
    tok.pad_token = tok.eos_token
    model = surgered(host)
    start = layer_tensors(model)
    trainer = _trainer(model, tok, tmp_path / "out", max_steps=4)
    trainer.train()
    trainer.save_model(tmp_path / "saved")
    trained = layer_tensors(model)
    assert not same(start, trained)
    for d in ("out/checkpoint-2", "out/checkpoint-4", "saved"):
        restored = layer_tensors(load_inserted(AutoModelForCausalLM.from_pretrained(host), tmp_path / d))
        assert same(restored, trained) == (d != "out/checkpoint-2"), d
    step2 = layer_tensors(load_inserted(AutoModelForCausalLM.from_pretrained(host), tmp_path / "out/checkpoint-2"))
    assert not same(step2, start) and not same(step2, trained)

    again = surgered(host, seed=1)  # other initial layers: the checkpoint must replace them
    resumed = _trainer(again, tok, tmp_path / "out", max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    got = layer_tensors(again)
    assert all(torch.allclose(got[k], trained[k], atol=1e-6) for k in trained)  # as the uninterrupted run


def test_peft_lora_beside_the_layers_trains_their_copies_and_save_inserted_writes_them(host, tmp_path):
    """Insert, then peft's get_peft_model with the blocks in modules_to_save, under Trainer: LoRA and the blocks'
    copies train (the originals stay); inserted_layers, set_tau and save_inserted reach the copies, and load_inserted
    restores them into a fresh host; Trainer's checkpoint (peft's own save) loads back with PeftModel.from_pretrained;
    inserting into the peft model is refused."""
    from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model

    from llm_surgery.insert import save_inserted, set_tau

    tok = word_tokenizer()
    tok.pad_token = tok.eos_token
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["pre_ssm"])
    model = get_peft_model(surgered(host), lora)
    host_logits = AutoModelForCausalLM.from_pretrained(host)(ids()).logits
    start = layer_tensors(model)
    _trainer(model, tok, tmp_path / "out", max_steps=2).train()
    model.eval()
    trained = layer_tensors(model)
    assert not same(start, trained)
    assert any(v.abs().sum() > 0 for k, v in model.state_dict().items() if "lora_B" in k)
    with model.disable_adapter():  # LoRA off and the original blocks, untrained (out_proj 0): the host
        assert same(layer_tensors(model), start)
        assert torch.allclose(model(ids()).logits, host_logits, atol=1e-6)
    assert set_tau(model, 0.5) == 2 and all(b.mixer.tau == 0.5 for b in inserted_layers(model).values())

    save_inserted(model, tmp_path / "layers")
    assert same(layer_tensors(load_inserted(AutoModelForCausalLM.from_pretrained(host), tmp_path / "layers")), trained)
    again = PeftModel.from_pretrained(surgered(host, seed=1), tmp_path / "out" / "checkpoint-2")
    assert same(layer_tensors(again), trained)
    assert torch.allclose(again(ids()).logits, model(ids()).logits, atol=1e-6)
    # as README warns: peft's Auto class rebuilds the host from its path, without the layers
    dropped = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-2")
    assert not any(name.endswith("pre_ssm") for name, _ in dropped.named_modules())

    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match="insert the layers before peft's get_peft_model"):
        insert_layers(model, "mamba2", 1)
    assert [p.requires_grad for p in model.parameters()] == flags


@pytest.mark.slow
def test_trl_sft_trainer_trains_and_checkpoints_the_layers(host, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is the optional extra llm-surgery[trl]")
    from datasets import Dataset

    tok = word_tokenizer()
    model = surgered(host)
    start = layer_tensors(model)
    data = Dataset.from_list([{"prompt": f"{a} {b} ->", "completion": f" {b} {a}"} for a, b in PAIRS])
    # Granite 4.0's config carries a router loss coefficient; TRL (1.16) then adds the experts' load-balancing loss,
    # reading `num_experts`, which Granite names `num_local_experts`. Without experts to balance: off.
    model.config.router_aux_loss_coef = 0.0
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, save_steps=1, per_device_train_batch_size=4,
                         learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                         disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    trained = layer_tensors(model)
    assert not same(start, trained)
    restored = layer_tensors(load_inserted(AutoModelForCausalLM.from_pretrained(host), tmp_path / "out/checkpoint-2"))
    assert same(restored, trained)


def test_example_data_is_what_its_generator_makes():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import cup_swaps

    for name, n, seed in (("train", 600, 0), ("test", 100, 1)):
        shipped = (cup_swaps.DATA / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in shipped] == cup_swaps.make_records(n, seed)


@pytest.mark.slow
def test_example_fine_tunes_with_trainer_and_evaluates(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import cup_swaps

    result = cup_swaps.main(["--max-steps", "4", "--output-dir", str(tmp_path)])
    assert result["steps"] == 4 and 0.0 <= result["test_exact_match_host_alone"] <= 1.0
    assert 0.0 <= result["test_exact_match"] <= 1.0
    assert (tmp_path / "final" / "inserted.json").is_file() and (tmp_path / "checkpoint-2" / "inserted.json").is_file()
