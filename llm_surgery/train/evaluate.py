"""Box evaluation for the trainer, sharded over processes and gathered with `accelerator.gather_for_metrics`.

Two modes give the same exact-match verdict where both apply:
- "teacher_forced" (default): one forward per batch; an example is right when the argmax at every completion
  position (and at EOS) equals the target token, which is exactly when greedy decoding would reproduce the
  target. Left padding puts every completion at the end of its row, so only the last logits are computed
  (`logits_to_keep`). Works under DDP and FSDP.
- "generate": `greedy_complete` on the unwrapped model and the order-insensitive Box scorer (not under FSDP).
"""

from __future__ import annotations

import torch

from llm_surgery.box_data import IGNORE_INDEX, BoxCollator, greedy_complete, is_correct, score

from .data import TokenizedBox
from .setup import make_accelerator, mark_trainable, upcast_trainable, use_cuda_kernels


class EvalSet:
    """One split's records, tokenized once, with a prepared (sharded) loader over length-sorted indices."""

    def __init__(self, accelerator, tokenizer, name: str, records, batch_size: int):
        self.name, self.records = name, list(records)
        self.data = TokenizedBox(tokenizer, self.records)
        order = sorted(range(len(self.data)), key=lambda i: len(self.data[i]["input_ids"]))
        loader = torch.utils.data.DataLoader(order, batch_size=batch_size, collate_fn=torch.tensor)
        self.loader = accelerator.prepare_data_loader(loader)


def completion_span(labels: torch.Tensor) -> int:
    """How many final positions hold scored tokens (left padding puts every completion at the end). Call it
    on the CPU batch: on a GPU tensor it would synchronise."""
    scored = (labels != IGNORE_INDEX).any(0).nonzero()
    if len(scored) == 0:
        raise ValueError("a batch without any completion token")
    return labels.shape[1] - int(scored[0])


def completion_loss_inputs(model, batch: dict, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for the last `k` (completion) positions only ([B, k, V]) and their labels ([B, k])."""
    labels = batch["labels"]
    if k is None:
        k = completion_span(labels)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                logits_to_keep=k + 1)
    return out.logits[:, :-1], labels[:, -k:]


@torch.no_grad()
def evaluate(accelerator, model, tokenizer, evalset: EvalSet, train_max_ops: int,
             mode: str = "teacher_forced", max_new_tokens: int = 24) -> dict:
    """score()-style results (overall, IID, OOD, per number of operations) on every process."""
    if mode not in ("teacher_forced", "generate"):
        raise ValueError(f"eval mode must be 'teacher_forced' or 'generate', got {mode!r}")
    collate = BoxCollator(tokenizer, padding_side="left")
    was_training = model.training
    model.eval()
    all_idx, all_ok, all_tok = [], [], []
    try:
        for idx in evalset.loader:
            feats = [evalset.data[i] for i in idx.tolist()]
            if mode == "teacher_forced":
                cpu = collate(feats)
                span = completion_span(cpu["labels"])
                batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in cpu.items()}
                with accelerator.autocast():  # also for a model that is not prepared (train/graphs.py)
                    logits, labels = completion_loss_inputs(model, batch, span)
                mask = labels != IGNORE_INDEX
                hit = (logits.argmax(-1) == labels) & mask
                ok = (hit | ~mask).all(-1)
                tokens = torch.stack([hit.sum(-1), mask.sum(-1)], -1)
            else:
                contexts = [evalset.records[i]["context"] for i in idx.tolist()]
                with accelerator.autocast():
                    preds = greedy_complete(accelerator.unwrap_model(model), tokenizer, contexts,
                                            max_new_tokens=max_new_tokens, batch_size=len(contexts))
                ok = torch.tensor([is_correct(p, evalset.records[i]["target"]) for p, i in zip(preds, idx.tolist())],
                                  device=accelerator.device)
                tokens = torch.zeros(len(ok), 2, dtype=torch.long, device=accelerator.device)
            g_idx, g_ok, g_tok = accelerator.gather_for_metrics((idx.to(accelerator.device), ok, tokens))
            all_idx.append(g_idx.cpu())
            all_ok.append(g_ok.cpu())
            all_tok.append(g_tok.cpu())
    finally:
        model.train(was_training)
    verdict = dict(zip(torch.cat(all_idx).tolist(), torch.cat(all_ok).tolist()))
    if len(verdict) != len(evalset.records):
        raise RuntimeError(f"evaluation of {evalset.name} covered {len(verdict)} of {len(evalset.records)} examples")
    # The scorer takes completions: the target itself when right, a non-completion when wrong.
    preds = [r["target"] if verdict[i] else " <wrong>" for i, r in enumerate(evalset.records)]
    result = score(evalset.records, preds, train_max_ops=train_max_ops)
    if mode == "teacher_forced":
        counts = dict(zip(torch.cat(all_idx).tolist(), torch.cat(all_tok).tolist()))
        _add_token_accuracy(result, evalset.records, counts, train_max_ops)
    return result


def _add_token_accuracy(result: dict, records, counts: dict, train_max_ops: int) -> None:
    """Share of completion tokens (EOS included) predicted right: a finer signal than exact match while a small
    model is still learning."""
    def share(keep):
        hit = sum(counts[i][0] for i, r in enumerate(records) if keep(r))
        total = sum(counts[i][1] for i, r in enumerate(records) if keep(r))
        return hit / total if total else None
    result["token_accuracy"] = share(lambda r: True)
    result["iid"]["token_accuracy"] = share(lambda r: r["num_ops"] <= train_max_ops)
    result["ood"]["token_accuracy"] = share(lambda r: r["num_ops"] > train_max_ops)
    for n, part in result["by_num_ops"].items():
        part["token_accuracy"] = share(lambda r, n=n: r["num_ops"] == n)


def evaluate_run(run_dir, split: str = "test", accelerator=None, within=None) -> dict:
    """Evaluate a finished run's saved artifact (`<run_dir>/final`) again, in this process alone, with the run's
    own config.json: its host, data and precision. The results must equal the run's gathered ones (results.json):
    a check that sharded evaluation neither drops nor repeats examples. `within`: a function of the model giving a
    context manager to evaluate inside, e.g. `llm_surgery.insert.ablation.tokens_alone` (the inserted mixers see
    each token alone: what the layers give without their memory) or `llm_surgery.insert.probe.SelectionProbe`."""
    import json
    from pathlib import Path

    from .artifact import load_trained
    from .config import TrainConfig
    from .data import cap_records, make_splits
    from .host import embedded_host, load_pretrained, resolve_dtype

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file() or not (run_dir / "final").is_dir():
        raise FileNotFoundError(f"{run_dir} is not a finished run (needs config.json and final/)")
    cfg = TrainConfig(**{**json.loads((run_dir / "config.json").read_text()), "fsdp": False, "resume": None})
    if cfg.random_init_config:
        raise ValueError(f"{run_dir} trained on a random-init host that was never saved; nothing to reload")
    if cfg.dataset != "box":
        raise ValueError(f"{run_dir} trained on --dataset {cfg.dataset}; evaluate_run re-evaluates Box runs (its "
                         "results.json holds the own-data evaluation)")
    accelerator = accelerator or make_accelerator(cfg)
    on_cuda = accelerator.device.type == "cuda"
    use_cuda_kernels(cfg, accelerator, log=lambda msg: None)  # the run's kernels, as it evaluated with them
    host = cfg.model or str(embedded_host(cfg, log=lambda msg: None))
    model, tokenizer = load_pretrained(host, resolve_dtype(cfg.host_dtype, on_cuda), accelerator.device)
    load_trained(model, run_dir / "final")
    mark_trainable(model)  # the tensors the run trained, kept in float32 under autocast as it kept them
    upcast_trainable(model, accelerator)
    model.config.use_cache = False
    model = accelerator.prepare(model)
    splits = make_splits(cfg.num_sequences, cfg.data_seed, cfg.train_max_ops, cfg.test_max_ops)
    evalset = EvalSet(accelerator, tokenizer, split, cap_records(splits[split], cfg.max_eval_examples),
                      cfg.eval_batch_size)
    if within is None:
        return evaluate(accelerator, model, tokenizer, evalset, cfg.train_max_ops, cfg.eval_mode)
    with within(accelerator.unwrap_model(model)):
        return evaluate(accelerator, model, tokenizer, evalset, cfg.train_max_ops, cfg.eval_mode)


def compare_results(gathered: dict, single: dict) -> dict:
    """Two evaluations of one checkpoint on one split (e.g. gathered over a run's processes, and `evaluate_run`):
    whether the example counts per number of operations agree, and the largest accuracy difference over overall,
    IID, OOD and each number of operations (exact match and token accuracy)."""
    count = lambda r: {str(k): v["num_examples"] for k, v in r["by_num_ops"].items()}
    pairs = [(gathered, single), (gathered["iid"], single["iid"]), (gathered["ood"], single["ood"])]
    by_ops = {str(k): v for k, v in single["by_num_ops"].items()}  # keys are strings once read from JSON
    pairs += [(v, by_ops.get(str(k), {})) for k, v in gathered["by_num_ops"].items()]
    diffs = []
    for part in ("accuracy", "token_accuracy"):
        for a, b in pairs:
            x, y = a.get(part), b.get(part)
            if (x is None) != (y is None):  # one evaluation lacks a figure the other has
                diffs.append(float("inf"))
            elif x is not None:
                diffs.append(abs(x - y))
    return {"num_examples": [gathered["num_examples"], single["num_examples"]],
            "counts_equal": count(gathered) == count(single), "max_abs_accuracy_diff": max(diffs, default=None),
            "accuracy": [gathered["accuracy"], single["accuracy"]],
            "token_accuracy": [gathered.get("token_accuracy"), single.get("token_accuracy")]}
