"""The MAD bench (llm_surgery/bench/mad): each task generator's defining property, a short run that learns an easy
setting, and the CLI's refusals."""

import json

import numpy as np
import pytest
import torch

from llm_surgery.bench.mad.__main__ import main, select
from llm_surgery.bench.mad.model import MADModel
from llm_surgery.bench.mad.tasks import IGNORE, TASKS, memorize_table
from llm_surgery.bench.mad.train import RunConfig, evaluate, train


def sample(name, n, train, seed=0, **settings):
    task = TASKS[name]
    return task.generate(np.random.default_rng(seed), n, train, **{**task.settings, **settings})


def pairs_and_answers(x, y):
    """Per sequence: its inputs and every scored (position, target)."""
    for xi, yi in zip(x, y):
        yield xi, [(int(p), int(yi[p])) for p in np.flatnonzero(yi != IGNORE)]


@pytest.mark.parametrize("name", ["in_context_recall", "noisy_in_context_recall"])
def test_recall_answers_are_the_values_the_context_gave_their_keys(name):
    task = TASKS[name]
    n_tok = task.vocab_size - task.settings.get("noise_vocab_size", 0)
    x, y = sample(name, 200, train=False)
    assert x.shape == (200, task.settings["seq_len"] - 1)
    scored_any = 0
    for xi, answers in pairs_and_answers(x, y):
        # the answer at position p is the value that followed the key x[p] at its earlier occurrences
        assert answers and answers[-1][0] == len(xi) - 1  # the final query is always scored
        for p, target in answers:
            key = xi[p]
            assert p % 2 == 0 and key < n_tok // 2
            earlier = [xi[q + 1] for q in range(0, p, 2) if xi[q] == key]
            assert earlier and set(earlier) == {target}
            scored_any += 1
        # every key keeps one value within the sequence; every repeated key is asked for
        kv = {}
        for q in range(0, len(xi) - 1, 2):
            if xi[q] < n_tok // 2:
                assert kv.setdefault(xi[q], xi[q + 1]) == xi[q + 1]
                assert (q in dict(answers)) == (list(xi[:q:2]).count(xi[q]) > 0)
    assert scored_any > 200
    # training targets: the next token everywhere
    xt, yt = sample(name, 4, train=True)
    assert (xt[:, 1:] == yt[:, :-1]).all()


def test_noisy_recall_noise_tokens_are_never_keys_or_values():
    task = TASKS["noisy_in_context_recall"]
    n_tok = task.vocab_size - task.settings["noise_vocab_size"]
    x, y = sample("noisy_in_context_recall", 300, train=False)
    first, second = x[:, 0:-1:2], x[:, 1::2]
    noise = first >= n_tok
    assert 0.15 < noise.mean() < 0.25  # MAD's 20% of the pairs
    # a pair is either two noise tokens or (key, value) of the non-noise vocabulary; the query key is real
    assert ((second >= n_tok) == noise).all()
    assert (first[~noise] < n_tok // 2).all() and (second[~noise] >= n_tok // 2).all()
    assert (x[:, -1] < n_tok // 2).all()
    scored = y != IGNORE
    assert (y[scored] >= n_tok // 2).all() and (y[scored] < n_tok).all()
    assert (x[scored] < n_tok // 2).all()  # every scored position holds a key


def runs(seq, key_vocab):
    """Split a fuzzy-recall sequence (padding removed) into alternating key and value motifs."""
    out, cur = [], [seq[0]]
    for a, b in zip(seq, seq[1:]):
        if (a < key_vocab) == (b < key_vocab):
            cur.append(b)
        else:
            out.append(tuple(cur))
            cur = [b]
    return out + [tuple(cur)]


def test_fuzzy_recall_keys_and_values_are_multi_token_and_answers_follow_the_context():
    task = TASKS["fuzzy_in_context_recall"]
    pad, key_vocab = task.vocab_size - 1, (task.vocab_size - 1) // 2
    k_max, v_max = task.settings["k_motif_size"], task.settings["v_motif_size"]
    x, y = sample("fuzzy_in_context_recall", 100, train=False)
    answered = 0
    for xi, yi in zip(x, y):
        start = int(np.argmax(xi != pad))
        # the last value token is no input but the last target: the whole sequence from both
        full = list(xi[start:]) + [int(yi[-1])]
        motifs = runs(full, key_vocab)
        keys, values = motifs[0::2], motifs[1::2]
        assert all(len(k) == k_max for k in keys)  # evaluation keys have the longest motif
        assert all(1 <= len(v) <= v_max for v in values) and all(len(set(k)) == len(k) for k in keys)
        assert any(len(v) > 1 for v in values)
        pos, kv = start, {}
        for k, v in zip(keys, values):
            pos += len(k)
            targets = [int(t) for t in yi[pos - 1:pos - 1 + len(v)]]  # target j predicts input j + 1
            if k in kv:
                assert kv[k] == v and targets == list(v)
                answered += 1
            else:
                assert set(targets) == {IGNORE}
                kv[k] = v
            pos += len(v)
    assert answered >= 100  # the final query at least
    xt, yt = sample("fuzzy_in_context_recall", 50, train=True)
    lengths = {len(k) for xi in xt for k in runs(list(xi[int(np.argmax(xi != pad)):]), key_vocab)[0::2][:-1]}
    assert lengths == {1, 2, 3}  # training keys take every motif size


def test_memorize_map_is_fixed_across_sequences_and_splits():
    task = TASKS["memorize"]
    table = memorize_table(task.vocab_size, 12345)
    assert len(set(table.tolist())) == len(table)  # distinct values
    for seed, train in ((0, True), (1, False)):
        x, y = sample("memorize", 64, train, seed=seed)
        assert (x[:, 1::2] == task.vocab_size - 1).all() and (y[:, 0::2] == IGNORE).all()
        assert (y[:, 1::2] == table[x[:, 0::2]]).all()


def test_compress_target_is_the_input():
    x, y = sample("compress", 16, train=True)
    assert (x == y).all() and (x[:, -1] == TASKS["compress"].vocab_size - 1).all()
    assert (x[:, :-1] < TASKS["compress"].vocab_size - 1).all()


def test_selective_copy_targets_are_the_non_noise_tokens_in_order():
    task = TASKS["selective_copy"]
    m, blank, copy = task.settings["num_tokens_to_copy"], task.vocab_size - 2, task.vocab_size - 1
    x, y = sample("selective_copy", 100, train=True)
    assert x.shape == (100, task.settings["seq_len"])
    for xi, yi in zip(x, y):
        before = xi[: len(xi) - m - 1]
        assert xi[len(xi) - m - 1] == copy and (xi[len(xi) - m:] == blank).all()
        assert (yi[len(yi) - m:] == before[before != blank]).all() and (yi[: len(yi) - m] == IGNORE).all()
    assert len({tuple(np.flatnonzero(xi != blank)[:3]) for xi in x}) > 50  # the tokens' places vary


def test_mad_accuracy_is_class_averaged_over_targets_and_predictions():
    class Fixed(torch.nn.Module):
        def __init__(self, pred):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.pred = pred

        def forward(self, tokens):
            return torch.nn.functional.one_hot(self.pred[: len(tokens)], 4).float() + 0 * self.w

    targets = torch.tensor([[0, 0, 0, 1, IGNORE]])
    pred = torch.tensor([[0, 0, 2, 1, 3]])  # class 0: 2/3, class 1: 1/1, class 2 predicted only: 0; 3 unscored
    res = evaluate(Fixed(pred), torch.zeros_like(targets), targets, 4)
    assert res["acc"] == pytest.approx((2 / 3 + 1 + 0) / 3) and res["acc_token"] == pytest.approx(3 / 4)


def test_models_of_every_kind_map_tokens_to_logits():
    for kind in ("attention", "pdssm", "mamba2", "deltanet"):
        for autoencoder in (False, True):
            model = MADModel(kind, vocab_size=12, seq_len=6, d_model=32, n_layers=1, autoencoder=autoencoder)
            assert model(torch.randint(0, 12, (2, 6))).shape == (2, 6, 12)


def test_attention_learns_tiny_in_context_recall():
    cfg = RunConfig(task="in_context_recall", kind="attention", lr=3e-3, max_steps=200, batch_size=32, d_model=32,
                    settings=dict(vocab_size=8, seq_len=12), num_train=6400, eval_examples=256, validate=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest on a busy machine
    try:
        row = train(cfg)
    finally:
        torch.set_num_threads(threads)
    # 4 possible values: chance is 25%; after 200 steps the model recalls about 60% (100% given longer)
    assert row["test_acc_token"] > 0.45 and row["test_acc"] > 0.45, row


def test_rate_choice_reads_validation_never_test():
    rows = [dict(kind="pdssm", task="memorize", seed=s, lr=lr, validation_acc=v, test_acc=t)
            for s in (0, 1) for lr, v, t in ((1e-3, 0.5, 0.9), (5e-4, 0.6, 0.1))]
    assert {r["lr"] for r in select(rows)[("pdssm", "memorize")]} == {5e-4}


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "recall"], "unknown 'recall'"), (["--kinds", "gpt"], "unknown 'gpt'"),
    (["--steps", "0"], "expected an integer >= 1"), (["--seeds", "x"], "a count >= 1"),
    (["--lr", "0"], "positive learning rates"), (["--weight-decay", "-1"], "must be >= 0"),
    (["--summarize", "/nonexistent/rows.jsonl"], "no such file"),
])
def test_bad_flags_are_one_line_errors_with_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(argv + ["--cpu"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("python -m llm_surgery.bench.mad: error:")


def test_cli_prints_each_task_and_a_table(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["--kinds", "attention", "--tasks", "memorize,compress", "--steps", "2", "--seeds", "1",
                 "--batch-size", "8", "--cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memorize (MAD memorization)" in text and "compress (MAD compression)" in text
    assert "| attention |" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["task"] for r in rows} == {"memorize", "compress"} and all(r["steps"] == 2 for r in rows)
