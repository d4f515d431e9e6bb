"""The state-tracking trainer and CLI, and the Flash PD-SSM options added for learning state tracking."""

import json

import pytest
import torch

from llm_surgery.bench.state_tracking.__main__ import _seeds, main, parse_args as parse_cli, summarize
from llm_surgery.bench.state_tracking.model import StateTracker
from llm_surgery.bench.state_tracking import train as train_module
from llm_surgery.bench.state_tracking.train import (KIND_DEFAULTS, ONE_LAYER_RECIPES, PDSSM_PRESETS,
                                                    TrainConfig, TrainRun, adapt_len, candidate_seed, cli_defaults, evaluate,
                                                    held_out_generator, lr_at, max_train_len, needs_retry,
                                                    param_groups, preset_for, progress, train)
from llm_surgery.bench.state_tracking.tasks import get_task
from llm_surgery.layers import FlashPDSSM


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_frac=0.1)
    lrs = [lr_at(progress(s, 0.0, cfg), cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 1e-5


def test_curriculum_ramps_to_max_len():
    cfg = TrainConfig(steps=100, curriculum_frac=0.5, min_len=1, max_len=40)
    assert max_train_len(0.0, cfg) == 2 and max_train_len(0.5, cfg) == 40 and max_train_len(0.99, cfg) == 40
    assert max_train_len(0.25, cfg) == 21
    assert max_train_len(0.0, TrainConfig(steps=100)) == 40


def test_adaptive_curriculum_raises_the_length_only_while_the_loss_is_low(monkeypatch):
    cfg = TrainConfig(curriculum_mode="adaptive", curriculum_threshold=0.3, curriculum_step=2, max_len=40)
    assert adapt_len(10, 0.1, cfg) == 12 and adapt_len(10, 0.5, cfg) == 10 and adapt_len(39, 0.0, cfg) == 40
    # end to end: a threshold no loss reaches holds the length at min_len + 1; one every loss is below raises it
    # by curriculum_step at each of the steps // ADAPT_EVERY checks (a check every 2 steps here, to stay short)
    monkeypatch.setattr(train_module, "ADAPT_EVERY", 2)
    small = dict(task="parity", n_layers=1, d_model=16, steps=3 * 2, batch_size=8, eval_lengths=(40,),
                 eval_batch=8, mixer=dict(num_heads=2), curriculum_mode="adaptive", curriculum_step=3)
    assert train(TrainConfig(curriculum_threshold=0.0, **small))["train_max_len"] == 2
    assert train(TrainConfig(curriculum_threshold=1e9, **small))["train_max_len"] == 2 + 3 * 3
    assert train(TrainConfig(**{**small, "curriculum_mode": "linear"}))["train_max_len"] == 40
    with pytest.raises(ValueError, match="curriculum_mode"):
        TrainConfig(curriculum_mode="fast")


def test_progress_runs_on_time_under_a_time_limit():
    """A time-limited run reaches the end of its schedules (lr -> 0, full curriculum) when time runs out."""
    cfg = TrainConfig(steps=100_000, time_limit_s=10.0, curriculum_frac=0.3)
    assert progress(10, 1.0, cfg) == pytest.approx(0.1) and progress(50_000, 1.0, cfg) == pytest.approx(0.5)
    assert progress(10, 12.0, cfg) == 1.0 and lr_at(1.0, cfg) < 1e-12 and max_train_len(0.3, cfg) == 40
    assert progress(10, 5.0, TrainConfig(steps=100)) == pytest.approx(0.1)  # no limit: steps only


def test_restarts_continue_the_candidate_with_the_lowest_training_loss():
    cfg = TrainConfig(task="parity", n_layers=1, d_model=16, steps=20, batch_size=8, eval_lengths=(40,),
                      eval_batch=8, restarts=3, restart_frac=0.25, mixer=dict(num_heads=2))
    r = train(cfg)
    assert len(r["restart_losses"]) == 3 and r["steps_run"] == 20
    best = min(range(3), key=lambda i: r["restart_losses"][i])
    assert r["chosen_seed"] == candidate_seed(0, best) and candidate_seed(0, 0) == 0
    plain = train(TrainConfig(**{**cfg.__dict__, "restarts": 1}))
    assert plain["restart_losses"] == [] and plain["chosen_seed"] == 0
    with pytest.raises(ValueError, match="restart"):
        TrainConfig(restarts=2, restart_frac=1.0)


def test_unfit_runs_are_retried_from_a_new_seed(tmp_path):
    """needs_retry: budget used up, validation unsolved, training loss above retry_loss (NaN too); train then
    runs the next try from candidate_seed(seed, 0, attempt), on the same test sequences, into its own folder."""
    row = {"train_loss": 0.5, "val_best": 0.6, "config": {"stop_acc": 1.0}}
    assert needs_retry(row, 1e-3) and needs_retry({**row, "train_loss": float("nan")}, 1e-3)
    assert not needs_retry({**row, "train_loss": 1e-4}, 1e-3)
    assert not needs_retry({**row, "solved": True}, 1e-3) and not needs_retry({**row, "val_best": 1.0}, 1e-3)
    assert len({candidate_seed(5, r, a) for r in range(3) for a in range(3)}) == 9 and candidate_seed(5, 0, 0) == 5
    # 3 steps cannot fit parity: every try is unfit, so retries=2 makes three tries
    cfg = TrainConfig(task="parity", n_layers=1, d_model=16, steps=3, batch_size=8, eval_lengths=(40,),
                      eval_batch=8, eval_every=3, stop_acc=2.0, seed=5, retries=2, retry_loss=1e-6,
                      mixer=dict(num_heads=2))
    r = train(cfg, run_dir=str(tmp_path / "run"))
    assert r["config"]["attempt"] == 2 and r["chosen_seed"] == candidate_seed(5, 0, 2) and not r["solved"]
    assert [a["chosen_seed"] for a in r["earlier_attempts"]] == [5, candidate_seed(5, 0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-attempt1", "run-attempt2"]
    assert train(cfg, run_dir=str(tmp_path / "run"))["acc"] == r["acc"]   # finished tries are not retrained
    once = train(TrainConfig(**{**cfg.__dict__, "retries": 0}))
    assert once["config"]["attempt"] == 0 and "earlier_attempts" not in once
    with pytest.raises(ValueError, match="retries"):
        TrainConfig(retries=-1)


def test_validation_keeps_the_best_weights_and_reports_them_on_the_test_set():
    cfg = TrainConfig(task="parity", n_layers=1, d_model=16, steps=12, batch_size=8, eval_lengths=(40, 64),
                      eval_batch=16, eval_every=4, stop_acc=2.0, mixer=dict(num_heads=2))
    run = TrainRun(cfg, 0, get_task("parity"), torch.device("cpu"))
    first = run.validate()
    kept = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert run.validate() == first  # the same validation sequences at every call
    with torch.no_grad():  # worse weights: a constant prediction scores about half, below a run's best so far
        for p in run.model.parameters():
            p.zero_()
    run.best_val = 0.99
    run.validate()
    assert run.best_val == 0.99 and all(torch.equal(kept[k], v) for k, v in run.best_state.items())

    r = train(cfg)
    steps = [s for s, _ in r["val_curve"]]
    assert steps == [4, 8, 12] and r["steps_run"] == 12
    assert r["val_best"] == max(m for _, m in r["val_curve"]) == dict(r["val_curve"])[r["val_best_step"]]
    last_only = train(TrainConfig(**{**cfg.__dict__, "eval_every": 12}))   # one validation, after the last step:
    assert last_only["val_best_step"] == 12 and last_only["acc_selected"] == last_only["acc"]   # the final weights
    # the reported selection is the kept weights on the test sequences: retrain, pick the same step, evaluate
    again = TrainRun(cfg, 0, get_task("parity"), torch.device("cpu"))
    again.advance(r["val_best_step"] / cfg.steps)
    acc = evaluate(again.model, again.task, cfg.eval_lengths, cfg.eval_batch, held_out_generator(0),
                   torch.device("cpu"))
    assert {str(k): v for k, v in acc.items()} == r["acc_selected"]
    assert "acc_selected" not in train(TrainConfig(**{**cfg.__dict__, "eval_every": 0}))



def test_validation_judges_the_weight_average_and_leaves_training_weights_alone():
    """ema_decay: each step moves the average towards the weights; validation evaluates and keeps the average."""
    cfg = TrainConfig(task="parity", n_layers=1, d_model=16, steps=6, batch_size=8, eval_lengths=(40, 64),
                      eval_batch=16, eval_every=3, stop_acc=2.0, ema_decay=0.75, mixer=dict(num_heads=2))
    run = TrainRun(cfg, 0, get_task("parity"), torch.device("cpu"))
    plain = TrainRun(TrainConfig(**{**cfg.__dict__, "ema_decay": 0.0}), 0, get_task("parity"), torch.device("cpu"))
    want = [p.detach().clone() for p in plain.model.parameters()]
    for step in range(2):  # the average by hand, next to the same training without one
        plain.advance((step + 1) / cfg.steps)
        want = [0.75 * w + 0.25 * p.detach() for w, p in zip(want, plain.model.parameters())]
    run.advance(2 / cfg.steps)
    for a, w, p, q in zip(run.ema, want, run.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, w)
        assert torch.equal(p, q)  # the average does not feed back into training
    live = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.validate()
    assert all(torch.equal(live[k], v) for k, v in run.model.state_dict().items())
    kept = [run.best_state[n] for n, _ in run.model.named_parameters()]
    assert all(torch.equal(k, a) for k, a in zip(kept, run.ema)) and not all(
        torch.equal(k, p) for k, p in zip(kept, run.model.parameters()))
    r = train(cfg)
    assert [s for s, _ in r["val_curve"]] == [3, 6] and "acc_selected" in r
    with pytest.raises(ValueError, match="ema_decay needs eval_every"):
        TrainConfig(ema_decay=0.9)
    with pytest.raises(ValueError, match="ema_decay must be"):
        TrainConfig(ema_decay=1.0, eval_every=5)

def test_weight_decay_reaches_linear_weights_only():
    model = StateTracker(3, 2, d_model=16, n_layers=1, num_heads=2)
    decayed, kept = param_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decayed["params"]} == {
        "blocks.0.mixer.in_proj.weight", "blocks.0.mixer.x_proj.weight", "blocks.0.mixer.out_proj.weight",
        "head.weight"}
    assert len(decayed["params"]) + len(kept["params"]) == len(names)
    run = TrainRun(TrainConfig(task="parity", n_layers=1, d_model=16, weight_decay=0.1, mixer=dict(num_heads=2)),
                   0, get_task("parity"), torch.device("cpu"))
    before = run.model.blocks[0].mixer.decay_bias.clone(), run.model.head.weight.clone()
    run.set_lr(1.0)
    for p in run.model.parameters():  # zero gradients: only weight decay moves a parameter
        p.grad = torch.zeros_like(p)
    run.opt.step()
    assert torch.equal(run.model.blocks[0].mixer.decay_bias, before[0])
    torch.testing.assert_close(run.model.head.weight, before[1] * 0.9)


def test_adam_eps_comes_with_the_automaton_preset_and_reaches_the_optimizer():
    assert cli_defaults("pdssm", n_layers=2).adam_eps == 1e-6  # the automaton preset's training option
    assert cli_defaults("pdssm", n_layers=2, adam_eps=1e-7).adam_eps == 1e-7  # an explicit value wins
    assert cli_defaults("pdssm", preset="tracking", n_layers=2).adam_eps == 1e-8
    assert cli_defaults("pdssm", n_layers=1).adam_eps == cli_defaults("mamba2").adam_eps == 1e-8
    run = TrainRun(TrainConfig(task="parity", n_layers=1, d_model=16, adam_eps=1e-5, mixer=dict(num_heads=2)),
                   0, get_task("parity"), torch.device("cpu"))
    assert {g["eps"] for g in run.opt.param_groups} == {1e-5}
    with pytest.raises(ValueError, match="adam_eps"):
        TrainConfig(adam_eps=0.0)
    args = parse_cli(["--adam-eps", "3e-6", "--layers", "2"])
    assert args.adam_eps == 3e-6


def test_cli_defaults_per_kind():
    p = cli_defaults("pdssm", task="s3", n_layers=1)
    assert p.mixer == PDSSM_PRESETS["robust"] and p.task == "s3"  # auto: one layer -> robust
    deeper = cli_defaults("pdssm", n_layers=2).mixer
    assert deeper == PDSSM_PRESETS["automaton"] == cli_defaults("pdssm").mixer  # deeper -> automaton
    assert deeper["unit_snap"] > 0 and deeper["phase_levels"] == 60 and preset_for(2) == "automaton"
    assert deeper["b_gate"] == "decay" and deeper["x_init_std"] > 0
    assert cli_defaults("pdssm", preset="robust", n_layers=2, mixer={"conv_kernel": 4}).mixer == {
        **PDSSM_PRESETS["robust"], "conv_kernel": 4}
    assert preset_for(1) == "robust" and preset_for(3, "layer") == "layer"
    with pytest.raises(ValueError, match="preset"):
        preset_for(1, "fast")
    assert p.curriculum_frac == KIND_DEFAULTS["pdssm"].get("curriculum_frac", 0.0)
    assert cli_defaults("pdssm", preset="layer", mixer={"complex": False}).mixer == {"complex": False}
    m = cli_defaults("mamba2", curriculum_frac=None)
    assert m.mixer == {} and m.curriculum_frac == 0.0 and m.restarts == 1  # baselines: appendix B.1 as is
    assert m.retries == 0 and p.retries == 1 and cli_defaults("pdssm", retries=0).retries == 0


def test_config_errors():
    with pytest.raises(ValueError, match="min_len"):
        TrainConfig(min_len=0)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="unknown task"):
        train(TrainConfig(task="nope", steps=1))


def test_seeds_parsing():
    assert _seeds("3") == [0, 1, 2] and _seeds("4,7") == [4, 7] and _seeds("7,") == [7]
    with pytest.raises(ValueError, match="--seeds must be a count or a comma list of integers, got 'x'"):
        _seeds("x")


def test_cli_writes_jsonl_and_summary(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    main(["--kind", "pdssm", "--task", "parity,cycle_navigation", "--steps", "3", "--seeds", "2", "--layers", "1",
          "--d-model", "16", "--batch-size", "4", "--eval-lengths", "40,256", "--eval-batch", "8",
          "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["task"] for r in rows} == {"parity", "cycle_navigation"}
    assert all(r["steps_run"] == 3 and 0 <= r["acc_mean"] <= 1 and set(r["acc"]) >= {"40", "256"} for r in rows)
    assert rows[0]["config"]["mixer"]["b_gate"] == "decay"  # one layer: the robust preset by default
    main(["--task", "parity", "--steps", "2", "--seeds", "1", "--layers", "1", "--d-model", "16", "--batch-size", "4",
          "--preset", "layer", "--eval-lengths", "40", "--eval-batch", "4", "--out", str(out)])
    assert json.loads(out.read_text().splitlines()[-1])["config"]["mixer"] == {}
    assert "acc_selected" not in rows[0]  # the default --eval-every 1000 never came in 3 steps
    main(["--task", "parity", "--steps", "4", "--seeds", "1", "--layers", "1", "--d-model", "16", "--batch-size", "4",
          "--eval-every", "2", "--eval-lengths", "40", "--eval-batch", "4", "--out", str(out)])
    last = json.loads(out.read_text().splitlines()[-1])
    assert [s for s, _ in last["val_curve"]] == [2, 4] and set(last["acc_selected"]) == {"40"}
    main(["--task", "parity", "--steps", "2", "--seeds", "1", "--layers", "1", "--d-model", "16", "--batch-size", "4",
          "--eval-lengths", "40", "--eval-batch", "4", "--retries", "1", "--retry-loss", "1e-9", "--out", str(out)])
    retried = json.loads(out.read_text().splitlines()[-1])   # 2 steps never fit: one retry, then the result
    assert retried["config"]["attempt"] == 1 and len(retried["earlier_attempts"]) == 1
    main(["--task", "s3", "--steps", "1", "--seeds", "1", "--layers", "1", "--batch-size", "4", "--eval-lengths", "40",
          "--eval-batch", "4", "--mixer", '{"dict_size": 6}', "--out", str(out)])
    s3 = json.loads(out.read_text().splitlines()[-1])   # a group task at one layer: its recipe, under the flags
    assert s3["config"]["d_model"] == ONE_LAYER_RECIPES["s3"]["d_model"]
    expected = {**PDSSM_PRESETS["robust"], **ONE_LAYER_RECIPES["s3"]["mixer"], "dict_size": 6}
    assert s3["config"]["mixer"] == json.loads(json.dumps(expected))
    text = capsys.readouterr().out
    assert "| pdssm | parity | 2 |" in text and "validation-selected" in text
    with pytest.raises(SystemExit, match="^2$"):
        main(["--task", "dyck", "--steps", "1"])
    assert "unknown task 'dyck'; choose from parity" in capsys.readouterr().err


def test_summarize_mean_and_standard_error():
    rows = [{"kind": "pdssm", "task": "parity", "acc_mean": a} for a in (0.9, 1.0)]
    assert "| 2 | 95.0 ± 5.0 | — |" in summarize(rows)
    rows = [{**r, "acc_selected_mean": 1.0} for r in rows]
    assert "| 2 | 95.0 ± 5.0 | 100.0 ± 0.0 |" in summarize(rows)


def test_set_tau_reaches_every_pdssm_layer():
    m = StateTracker(3, 2, d_model=16, n_layers=2, kind="pdssm", num_heads=2)
    m.set_tau(0.25)
    assert [b.mixer.tau for b in m.blocks] == [0.25, 0.25]
    with pytest.raises(ValueError, match="tau must be a positive finite number"):   # the layer's own check
        m.set_tau(0.0)


def test_model_is_built_from_the_library_pieces():
    """No second copy of the library's parts: the norms are layers.common.RMSNorm (the inserted block's) and each
    kind's mixer is the registry's build_mixer(kind, d_model, **options), the same module on the same seed."""
    from llm_surgery.insert import block
    from llm_surgery.layers.common import RMSNorm
    from llm_surgery.layers.registry import build_mixer
    assert block.RMSNorm is RMSNorm
    for kind, opts in (("pdssm", dict(num_heads=2)), ("mamba2", {}), ("deltanet", {})):
        torch.manual_seed(3)
        m = StateTracker(3, 2, d_model=16, n_layers=1, kind=kind, mlp=True, **opts)
        assert [type(n) for n in (m.blocks[0].norm, m.blocks[0].mlp[0], m.norm)] == [RMSNorm] * 3
        torch.manual_seed(3)
        torch.nn.Embedding(3, 16)   # what the model draws before its first mixer
        ref, mixer = build_mixer(kind, 16, **opts), m.blocks[0].mixer
        assert type(ref) is type(mixer)
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), mixer.state_dict().values()))


@pytest.mark.parametrize("complex_", [False, True])
def test_hard_b_gate_can_close_the_injection(complex_):
    torch.manual_seed(0)
    layer = FlashPDSSM(16, num_heads=2, state_size=4, complex=complex_, b_gate="hard", x_init_std=1.0)
    u = torch.randn(2, 5, 16)
    _, D, b, _ = layer._ssm_inputs(u)
    assert D.shape == b.shape == (2, 2, 5, 4) and b.abs().sum() > 0
    with torch.no_grad():  # gate logits of every head far below -0.5: exactly no injection
        layer.x_proj.weight.view(2, -1, 16)[:, -1].zero_()
        layer.x_proj.weight.view(2, -1, 16)[:, -1, 0] = -100.0
    _, _, b, _ = layer._ssm_inputs(u.abs() + 0.1)
    assert b.abs().max() == 0
    y = layer(torch.randn(2, 5, 16))
    assert y.shape == (2, 5, 16) and torch.isfinite(y).all()


def test_decay_b_gate_scales_injection_by_one_minus_abs_d():
    u = torch.randn(2, 5, 16)
    torch.manual_seed(0)
    plain = FlashPDSSM(16, num_heads=2, state_size=4)
    torch.manual_seed(0)
    coupled = FlashPDSSM(16, num_heads=2, state_size=4, b_gate="decay")
    _, D, b, _ = plain._ssm_inputs(u)
    _, D2, b2, _ = coupled._ssm_inputs(u)
    assert torch.equal(D, D2)
    torch.testing.assert_close(b2, b * (1 - D.abs()))


def test_b_gate_options_and_errors():
    off = FlashPDSSM(16, num_heads=2, state_size=4, b_gate="off", x_init_std=1.0)
    _, _, b, _ = off._ssm_inputs(torch.randn(1, 3, 16))
    assert b.abs().max() == 0 and off.x_init.abs().sum() > 0
    assert FlashPDSSM(16, num_heads=2).x_init.abs().sum() == 0  # default unchanged: zero initial state
    assert FlashPDSSM(16, b_gate=True).b_gate == "sigmoid" and FlashPDSSM(16, b_gate=False).b_gate is None
    with pytest.raises(ValueError, match="b_gate"):
        FlashPDSSM(16, b_gate="relu")
    with pytest.raises(ValueError, match="x_init_std"):
        FlashPDSSM(16, b_gate="off")
    with pytest.raises(ValueError, match="x_init_std"):
        FlashPDSSM(16, x_init_std=-1.0)
