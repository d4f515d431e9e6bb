"""What a new user meets on the command lines: every refusal is one line with exit status 2 before any file
is written, negative numbers parse, `--help` shows every default (a recipe's: the paper's settings), and the
messages say what they mean."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_surgery.train.config import build_parser, parse_config

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, prog: str, message: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and message in err, err
    return err


def _exits_2(fn, *args, **kwargs):
    with pytest.raises(SystemExit, match="^2$"):
        fn(*args, **kwargs)


@pytest.fixture(scope="module")
def host_dir(tiny_host_dir):
    """A tiny Granite-4.0 host with 2 attention blocks, saved like a user's checkpoint."""
    return tiny_host_dir


# ---------------------------------------------------------------- flags and help

def test_negative_numbers_parse_and_are_refused_by_the_range_check(capsys):
    from llm_surgery.bench.state_tracking.__main__ import main as bench_main

    _exits_2(parse_config, ["--lr", "-1e-3"], prog="train")
    _one_line_error(capsys, "train", "lr must be a finite number in (0, inf), got -0.001")
    _exits_2(parse_config, ["--tau-end", "-inf"], prog="train")
    _one_line_error(capsys, "train", "tau_end must be a finite number in (0, inf), got -inf")
    assert parse_config(["--lr", "2E-4", "--tau", "1e0"]).lr == 2e-4  # positive scientific notation, as before
    _exits_2(bench_main, ["--lr", "-1e-3"])
    _one_line_error(capsys, "python -m llm_surgery.bench.state_tracking", "--lr must be a finite number > 0")


def _help_blocks(parser) -> dict[str, str]:
    """Each option's help text as printed by --help (its lines joined), by its first flag."""
    os.environ["COLUMNS"] = "1000"  # no wrapping (argparse would break hub ids at their hyphen)
    try:
        text = parser.format_help()
    finally:
        del os.environ["COLUMNS"]
    blocks, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current:
            blocks[current] += " " + line.strip()
    return blocks


def test_trainer_and_recipe_help_show_every_flag_with_its_default():
    from llm_surgery.train.paper import PAPER_HOSTS, recipe_defaults

    for defaults in [None, *(recipe_defaults(name) for name in PAPER_HOSTS)]:
        parser = build_parser(defaults, prog="x")
        blocks = _help_blocks(parser)
        flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
        assert set(flags) <= set(blocks)
        assert all("(default: " in blocks[f] for f in flags), [f for f in flags if "(default: " not in blocks[f]]
        assert "embedded tiny host" not in blocks["--model"]
    blocks = _help_blocks(build_parser(recipe_defaults("granite3b"), prog="recipes/granite3b.py"))
    for flag, shown in [("--model", "ibm-granite/granite-4.0-h-micro"), ("--lr", "0.0005"), ("--schedule", "cosine"),
                        ("--weight-decay", "0.1"), ("--warmup-ratio", "0.1"), ("--min-lr-ratio", "0.1"),
                        ("--tau", "1.0"), ("--tau-end", "0.1"), ("--n", "4"), ("--max-steps", "none"),
                        ("--max-eval-examples", "none"), ("--output-dir", "runs/granite3b")]:
        assert blocks[flag].endswith(f"(default: {shown})"), blocks[flag]
    assert _help_blocks(build_parser())["--model"].endswith("(default: none)")


@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["--lr", "-1"], 2)])
def test_help_and_a_bad_flag_answer_before_the_training_stack_is_imported(argv, status):
    """transformers, Accelerate and PEFT take seconds to import: the parse comes first."""
    code = ("import sys\nfrom llm_surgery.train import main\ntry:\n    main(sys.argv[1:], prog='x')\n"
            "except SystemExit as e:\n    print('exit', e.code, *sorted(m for m in ('transformers', 'accelerate', "
            "'peft', 'llm_surgery.train.trainer') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == f"exit {status}", proc.stdout[-500:] + proc.stderr[-500:]


def test_bench_help_shows_its_defaults_and_the_gpu_script_its_protocol_choices_once(monkeypatch, capsys):
    from llm_surgery.bench.state_tracking.__main__ import parser

    blocks = _help_blocks(parser())
    assert blocks["--steps"].endswith("(default: 100000)") and blocks["--seeds"].endswith("(default: 0,1,2,3,4)")
    assert all("(default" in b for f, b in blocks.items() if f != "-h")
    spec = importlib.util.spec_from_file_location("state_tracking_gpu", REPO / "bench" / "state_tracking_gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit, match="^0$"):
        gpu.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "[--protocol SETTINGS]" in text and text.count("table1,groups") == 1, text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "run_configs", lambda *a, **k: pytest.fail("a run started"))
    assert gpu.main(["--quick"]) == 2  # --device cuda by default
    assert capsys.readouterr().err.endswith("error: --device cuda: no CUDA device here (torch "
                                            f"{torch.__version__}); use --device cpu\n")


def test_messages_say_what_they_mean(capsys):
    from types import SimpleNamespace

    from llm_surgery.bench.state_tracking.__main__ import summarize
    from llm_surgery.train.trainer import launch_line

    _exits_2(parse_config, ["--mixed-precision", "fp8"], prog="train")
    err = _one_line_error(capsys, "train", "mixed_precision must be one of auto, no, bf16, fp16 (or none)")
    assert "None" not in err
    one = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(value="NO"), mixed_precision="no",
                          device=torch.device("cpu"), precision_source="default: auto")
    assert launch_line(one) == "llm-surgery train: 1 process, device cpu, no mixed precision (fp32) (from default: auto)"
    two = SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="MULTI_GPU"), mixed_precision="bf16",
                          device=torch.device("cpu"), precision_source="--mixed-precision")
    assert launch_line(two).startswith("llm-surgery train: 2 processes (MULTI_GPU), device cpu, mixed precision bf16")
    rows = [{"kind": "pdssm", "task": "parity", "acc_mean": 0.5, "acc": {"40": 0.5, "64": 0.5}}]
    assert "| acc 40, 64 (%) |" in summarize(rows)
    rows[0]["acc"] = {str(n): 0.5 for n in (40, 64, 256)}
    assert "| acc 40..256 (%) |" in summarize(rows)


def test_the_log_counts_host_and_inserted_parameters_apart(host_dir):
    from accelerate import Accelerator

    from llm_surgery.hosts import build_tiny_host
    from llm_surgery.train.trainer import _build_model

    lines = []
    cfg = parse_config(["--model", str(host_dir), "--kind", "mamba2", "--n", "2", "--cpu"])
    model, _, _, sizes = _build_model(cfg, Accelerator(cpu=True), lines.append)
    bare = sum(p.numel() for p in build_tiny_host("granite", hidden_size=32, vocab_size=model.config.vocab_size,
                                                   pattern="M*M*", mamba_chunk_size=64).parameters())
    assert sizes["host"] == bare and sizes["host"] + sizes["inserted"] == sizes["total"]
    line = next(line for line in lines if line.startswith("host "))
    assert f": {bare:,} params; inserted 2 x mamba2: {sizes['inserted']:,} params; all together " \
           f"{sizes['total']:,};" in line


# ---------------------------------------------------------------- refusals before any file

def test_n_beyond_the_attention_blocks_is_refused_before_the_host_loads_or_a_folder_is_made(host_dir, tmp_path,
                                                                                            monkeypatch, capsys):
    from llm_surgery.train import host, main

    def no_weights(*args, **kwargs):
        raise AssertionError("the host's weights were loaded")

    monkeypatch.setattr(host, "load_pretrained", no_weights)
    out = tmp_path / "run"
    _exits_2(main, ["--model", str(host_dir), "--n", "3", "--output-dir", str(out)], prog="train")
    _one_line_error(capsys, "train", "n=3: this host has 2 attention blocks")
    _exits_2(main, ["--model", str(host_dir), "--n", "2", "--positions", "0", "5", "--output-dir", str(out)],
             prog="train")
    _one_line_error(capsys, "train", "bad position 5")
    _exits_2(main, ["--n", "5", "--output-dir", str(out)], prog="train")  # the shipped host: 4 attention blocks
    _one_line_error(capsys, "train", "n=5: this host has 4 attention blocks")
    assert not out.exists()


@pytest.mark.parametrize("resume", ["latest", "nowhere/step-00000001"])
def test_resume_of_nothing_leaves_no_folder(host_dir, tmp_path, capsys, resume):
    from llm_surgery.train import main

    out = tmp_path / "new" / "run"
    _exits_2(main, ["--model", str(host_dir), "--resume", str(tmp_path / resume) if "/" in resume else resume,
                    "--output-dir", str(out)], prog="train")
    _one_line_error(capsys, "train", "does not exist" if "/" in resume else "no checkpoint under")
    assert not (tmp_path / "new").exists()


def test_a_recipe_with_a_bad_model_path_is_one_line(tmp_path, capsys):
    from llm_surgery.train.paper import run_recipe

    _exits_2(run_recipe, str(REPO / "recipes" / "granite350m.py"),
             ["--model", "/bad/path", "--output-dir", str(tmp_path / "run")])
    _one_line_error(capsys, "recipes/granite350m.py", "model path /bad/path does not exist")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_recipe_under_a_two_process_launch_fails_in_each_process_with_one_line(tmp_path):
    """Each process exits with status 2 and only rank 0 prints the one line; no traceback of ours, no abort. (The
    launcher itself reports its failed children and exits 1, and stops the others with SIGTERM once the first has
    exited: that is Accelerate's and torchrun's.)"""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "recipes/granite3b.py", "--model", "/bad/path",
           "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("recipes/granite3b.py: error:")]
    assert ours == ["recipes/granite3b.py: error: model path /bad/path does not exist"], proc.stderr
    codes = re.findall(r"exitcode  : (-?\d+)", proc.stderr)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr
    assert "llm_surgery/" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_bench_device_without_cuda_is_refused_before_any_run(monkeypatch, capsys):
    from llm_surgery.bench.state_tracking import __main__ as bench
    from llm_surgery.cli import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "_run_all", lambda *a, **k: pytest.fail("a run started"))
    _exits_2(bench.main, ["--device", "cuda", "--jobs", "4", "--steps", "1"])
    _one_line_error(capsys, "python -m llm_surgery.bench.state_tracking", "--device cuda: no CUDA device here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--device cuda:3: this machine has 1 CUDA device"):
        check_device("cuda:3")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        check_device("meta")
    for bad in (["--task", "dyck"], ["--kind", "lstm"], ["--seeds", "x"], ["--mixer", "[1]"], ["--steps", "0"]):
        _exits_2(bench.main, bad)
        assert capsys.readouterr().err.count("\n") == 1


def test_plot_of_missing_runs_names_the_folder(tmp_path, capsys):
    from llm_surgery.train.plot import main

    png = tmp_path / "compare.png"
    _exits_2(main, [str(tmp_path / "runs" / "pdssm"), "-o", str(png)])
    _one_line_error(capsys, "python -m llm_surgery.train.plot", f"{tmp_path / 'runs' / 'pdssm'} does not exist")
    (tmp_path / "empty").mkdir()
    _exits_2(main, [str(tmp_path / "empty"), "-o", str(png)])
    _one_line_error(capsys, "python -m llm_surgery.train.plot", "holds no finished run")
    assert not png.exists()


def test_make_host_writes_nothing_by_default_and_refuses_a_foreign_folder(tmp_path, capsys):
    from llm_surgery.train.host import SHIPPED_HOST
    from llm_surgery.train.make_host import main, parser

    _exits_2(main, [])
    _one_line_error(capsys, "python -m llm_surgery.train.make_host", "the following arguments are required: --out")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    _exits_2(main, ["--out", str(foreign)])
    _one_line_error(capsys, "python -m llm_surgery.train.make_host", "holds no host made by make_host")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert str(SHIPPED_HOST) in " ".join(_help_blocks(parser())["--out"].split())


def test_box_generate_refuses_empty_splits_and_a_folder_of_other_files(tmp_path, capsys):
    from llm_surgery.box_data.__main__ import main

    _exits_2(main, ["generate", "--out", str(tmp_path / "box"), "--num-sequences", "3", "--no-progress"])
    _one_line_error(capsys, "llm-surgery-box generate", "--num-sequences 3 gives no validation sequence")
    assert not (tmp_path / "box").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    _exits_2(main, ["generate", "--out", str(tmp_path / "mine"), "--num-sequences", "4", "--no-progress"])
    _one_line_error(capsys, "llm-surgery-box generate", "holds files that are not a Box dataset's (notes.txt)")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert main(["generate", "--out", str(tmp_path / "box"), "--split-sequences", "1", "0", "1",
                 "--no-progress"]) == 0  # an empty split asked for by name is fine


def test_load_inserted_of_a_missing_folder_is_a_value_error(host_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from llm_surgery import load_inserted

    with pytest.raises(ValueError, match=r"no inserted-layer checkpoint: .*missing/inserted.json does not exist"):
        load_inserted(AutoModelForCausalLM.from_pretrained(host_dir), tmp_path / "missing")


def test_bench_exits_1_when_a_run_failed(monkeypatch, capsys):
    from llm_surgery.bench.state_tracking import __main__ as bench

    row = {"kind": "pdssm", "task": "parity", "seed": 0, "acc_mean": 0.5, "acc": {"40": 0.5}, "acc_max_len": 0.5,
           "steps_run": 1, "seconds": 0}
    monkeypatch.setattr(bench, "_run_all", lambda configs, *a, **k: iter([row]))  # one of two runs came back
    assert bench.main(["--steps", "1", "--seeds", "2"]) == 1
    assert bench.main(["--steps", "1", "--seeds", "1"]) == 0
    assert "2 run(s) of 1 steps on cpu" in capsys.readouterr().out
