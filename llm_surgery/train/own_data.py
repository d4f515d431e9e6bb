"""The user's own data for the trainer (`--dataset PATH_OR_ID`): read with `datasets.load_dataset`, its format told
from its columns, tokenized with the host's own tokenizer with labels on what the model should learn, and checked
before any work.

Formats (TRL's): language modelling (`text`: loss on every token after the first), prompt-completion (`prompt`,
`completion`: loss on the completion and EOS only), conversational (`messages`, a list of `role`/`content` dicts,
rendered with the tokenizer's chat template: loss on the assistant turns only, each with what the template writes
after its content, e.g. an end-of-turn token).

Splits: the dataset's own (`train`, and every other split is evaluated), else a seeded hold-out of `--eval-ratio`
of `train` named `validation`. `--max-length N` with `--over-length drop` (default: a record over N tokens is left
out) or `truncate` (cut to its first N tokens; one left without a scored token is left out); both counted and
reported. Every problem the data has is a UsageError naming the file, line and field where there is one.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llm_surgery.box_data import IGNORE_INDEX

from .config import UsageError

EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
               "dev": "validation", "test": "test"}
FORMATS = {"text": "language modelling", "prompt_completion": "prompt-completion", "messages": "conversational"}


# ---------------------------------------------------------------- reading

@dataclass
class RawSplit:
    """One split's records and where each came from (for messages naming a file and line)."""
    rows: list[dict]
    places: list[str]  # "file line N" / "file row N", one per row


def _split_of(path: Path) -> str | None:
    stem = path.name.split(".")[0].lower()
    return next((SPLIT_NAMES[k] for k in sorted(SPLIT_NAMES, key=len, reverse=True)
                 if stem == k or stem.startswith((k + "-", k + "_"))), None)


def _local_files(path: Path) -> dict[str, list[Path]]:
    """{split: files} of a local file (all `train`) or folder (files named train*/validation*/test*, or else all of
    them `train`), every file of one supported type."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        files = [p for p in files if "".join(p.suffixes[-1:]).lower() in EXTENSIONS]
        if not files:
            raise UsageError(f"--dataset {path}: the folder holds no {'/'.join(EXTENSIONS)} file")
    kinds = {EXTENSIONS.get(p.suffix.lower()) for p in files}
    if None in kinds:
        raise UsageError(f"--dataset {path}: unsupported file type {path.suffix!r}; use one of "
                         f"{', '.join(EXTENSIONS)}")
    if len(kinds) > 1:
        raise UsageError(f"--dataset {path}: files of several types ({', '.join(sorted(kinds))}); use one")
    named = {p: _split_of(p) for p in files}
    if not any(named.values()):
        return {"train": files}
    unnamed = [p.name for p, s in named.items() if s is None]
    if unnamed:
        raise UsageError(f"--dataset {path}: {', '.join(unnamed)} is not named after a split (train, validation, "
                         "test) while other files are")
    out: dict[str, list[Path]] = {}
    for p, s in named.items():
        out.setdefault(s, []).append(p)
    return out


def _json_lines(path: Path) -> list[tuple[int, dict]] | None:
    """(line number, record) of every record of a JSON-lines file, each checked to be a JSON object; None for a
    file that is one JSON document (a `.json` list), which `datasets` reads itself."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError:
            pass  # JSON lines in a .json file
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {number}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path} line {number}: a record must be a JSON object, got {type(record).__name__}")
        lines.append((number, record))
    return lines


def _places(split: str, files: list[Path], n: int, json_lines: dict) -> list[str]:
    """Where each of a split's `n` rows is: file and line for JSON lines (`json_lines`: each JSON file's
    `_json_lines`) and CSV, file and row otherwise."""
    places = []
    for f in files:
        kind = EXTENSIONS[f.suffix.lower()]
        if kind == "json":
            lines = json_lines[f]
            places += [f"{f} line {i}" for i, _ in lines] if lines is not None else [f"{f} item {i}" for i in
                                                                                      range(n - len(places))]
        elif kind == "csv" and len(files) == 1:
            places += [f"{f} line {i + 2}" for i in range(n)]  # after the header
        elif len(files) == 1:
            places += [f"{f} row {i}" for i in range(n)]
        else:
            places += [f"{split} split row {i}" for i in range(n - len(places))]
    if len(places) != n:  # rows skipped by the reader: name rows, not lines
        places = [f"{split} split row {i}" for i in range(n)]
    return places


def _check_local(spec: str, files: dict[str, list[Path]], json_lines: dict) -> None:
    """Empty files, and in JSON lines (`json_lines`: each JSON file's `_json_lines`) malformed lines and fields of
    the wrong type, named with file and line before `datasets` reads them (its reader names neither)."""
    parsed = {}
    for split, split_files in files.items():
        rows, places = [], []
        for f in split_files:
            lines = json_lines.get(f)
            if f.stat().st_size == 0 or lines == []:
                raise UsageError(f"--dataset {spec}: the {split} split is empty ({f} holds no records)")
            rows += [r for _, r in lines or []]
            places += [f"{f} line {i}" for i, _ in lines or []]
        if rows:
            parsed[split] = RawSplit(rows, places)
    if parsed:
        fmt = detect_format(spec, parsed)
        for split in parsed.values():
            for record, place in zip(split.rows, split.places):
                _check_record(fmt, record, place)


def read_dataset(spec: str) -> dict[str, RawSplit]:
    """`--dataset` as {split: records}: a local file or folder, else a hub id (read when the user is online)."""
    import datasets

    path = Path(spec).expanduser()
    local = path.exists()
    if not local and (spec.startswith(("/", ".", "~")) or Path(spec).suffix.lower() in EXTENSIONS):
        raise UsageError(f"--dataset {spec} does not exist")
    json_lines = {}  # each local JSON file parsed once: checked here, and its line numbers name the rows
    if local:
        files = _local_files(path)
        json_lines = {f: _json_lines(f) for fs in files.values() for f in fs if EXTENSIONS[f.suffix.lower()] == "json"}
        _check_local(spec, files, json_lines)
        builder = EXTENSIONS[next(iter(files.values()))[0].suffix.lower()]
        args, kwargs = (builder,), {"data_files": {s: [str(f) for f in fs] for s, fs in files.items()}}
    else:
        args, kwargs, files = (spec,), {}, {}
    try:
        loaded = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types; the user needs one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UsageError(f"--dataset {spec} does not load: {why}") from None
    out = {}
    for split, ds in loaded.items():
        rows = ds.to_list()
        out[split] = RawSplit(rows, _places(split, files.get(split, []), len(rows), json_lines))
    return out


# ---------------------------------------------------------------- format and records

def detect_format(spec: str, splits: dict[str, RawSplit]) -> str:
    """The TRL format of the data from its columns (every split must have the same)."""
    formats = {}
    for name, split in splits.items():
        columns = sorted({k for r in split.rows for k in r})
        if "messages" in columns:
            formats[name] = "messages"
        elif "prompt" in columns and "completion" in columns:
            formats[name] = "prompt_completion"
        elif "prompt" in columns:
            raise UsageError(f"--dataset {spec}: the {name} split has 'prompt' but no 'completion' field "
                             f"(columns found: {', '.join(columns)})")
        elif "text" in columns:
            formats[name] = "text"
        else:
            raise UsageError(f"--dataset {spec}: cannot tell the format of the {name} split from its columns "
                             f"({', '.join(columns) or 'none'}); expected 'text' (language modelling), 'prompt' + "
                             "'completion' (prompt-completion) or 'messages' (conversational)")
    if len(set(formats.values())) > 1:
        raise UsageError(f"--dataset {spec}: the splits have different formats "
                         f"({', '.join(f'{k}: {FORMATS[v]}' for k, v in formats.items())})")
    return next(iter(formats.values()))


def _check_record(fmt: str, record: dict, place: str) -> None:
    if fmt == "messages":
        _messages(record, place)
    for key in {"text": ("text",), "prompt_completion": ("prompt", "completion")}.get(fmt, ()):
        _string(record, key, place)


def _string(record: dict, key: str, place: str) -> str:
    value = record.get(key)
    if value is None:
        raise UsageError(f"{place}: field '{key}' is missing")
    if isinstance(value, list):
        raise UsageError(f"{place}: field '{key}' is a list (conversational prompt-completion); put whole "
                         "conversations in a 'messages' field instead")
    if not isinstance(value, str):
        raise UsageError(f"{place}: field '{key}' must be a string, got {type(value).__name__}")
    return value


def _messages(record: dict, place: str) -> list[dict]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{place}: field 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UsageError(f"{place}: field 'messages' item {i} needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise UsageError(f"{place}: field 'messages' has no assistant turn to learn")
    return out


# ---------------------------------------------------------------- tokenization

def prepare_tokenizer(tokenizer, fmt: str, source: str):
    """The tokenizer ready for this data: a pad token (EOS, else UNK) when it has none, left padding (generation);
    a chat template for conversational data. Returns it."""
    if fmt == "messages" and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--dataset has 'messages' (conversational) but the tokenizer of {source} has no chat "
                         "template; save one with the tokenizer (tokenizer.chat_template = ...) or use "
                         "prompt-completion data")
    if fmt != "text" and tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {source} has no eos_token, which ends every completion; set one")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None and tokenizer.unk_token_id is None:
            raise UsageError(f"the tokenizer of {source} has no pad, eos or unk token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token_id is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    return tokenizer


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tokenizer, fmt: str, record: dict, place: str) -> dict:
    """input_ids, labels (-100 where no loss), and for prompt-completion and conversational data the prompt and
    target ids that greedy generation is checked against (the last assistant turn for conversations)."""
    out = _encode(tokenizer, fmt, record, place)
    out["labels"][0] = IGNORE_INDEX  # nothing precedes the first token: it is never predicted
    if all(t == IGNORE_INDEX for t in out["labels"]):
        raise UsageError(f"{place}: the record has no token to learn (after its first)")
    if not out.get("prompt"):  # nothing to generate from
        out.pop("target", None)
    return out


def _encode(tokenizer, fmt: str, record: dict, place: str) -> dict:
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if fmt == "text":
        ids = _ids(tokenizer, _string(record, "text", place), True) + eos
        return {"input_ids": ids, "labels": list(ids)}
    if fmt == "prompt_completion":
        prompt = _ids(tokenizer, _string(record, "prompt", place), True)
        target = _ids(tokenizer, _string(record, "completion", place), False) + eos
        return {"input_ids": prompt + target, "labels": [IGNORE_INDEX] * len(prompt) + target, "prompt": prompt,
                "target": target}
    messages = _messages(record, place)
    ids, labels, text, prompt, target = [], [], "", [], []
    for k, m in enumerate(messages):
        pieces = []
        if m["role"] == "assistant":
            head = _render(tokenizer, messages[:k], generation_prompt=True) if k else ""
            pieces.append((head, False))
            pieces.append((_render(tokenizer, messages[:k + 1]), True))
        else:
            pieces.append((_render(tokenizer, messages[:k + 1]), False))
        for full, scored in pieces:
            if not full.startswith(text):
                raise UsageError(f"{place}: the chat template does not render this conversation turn by turn (a "
                                 "longer conversation does not start with the shorter one's text), so the assistant "
                                 "turns cannot be told apart")
            piece = _ids(tokenizer, full[len(text):], special=False)  # the template writes its special tokens
            if scored:
                prompt, target = list(ids), piece
            ids += piece
            labels += piece if scored else [IGNORE_INDEX] * len(piece)
            text = full
    if not target:
        raise UsageError(f"{place}: the assistant turns render to no tokens")
    return {"input_ids": ids, "labels": labels, "prompt": prompt, "target": target}


class Encoded(torch.utils.data.Dataset):
    """Tokenized records (`features`, each with input_ids, attention_mask, labels) for the trainer's sampler and
    collator."""

    def __init__(self, features: list[dict]):
        self.features = features

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> dict:
        return {k: self.features[i][k] for k in ("input_ids", "attention_mask", "labels")}


@dataclass
class OwnData:
    """Everything the trainer needs of the user's data: the train set, the eval splits, the counts."""
    source: str
    format: str
    train: Encoded
    evals: dict[str, Encoded]
    report: dict = field(default_factory=dict)  # per split: records, over_max_length, truncated, dropped
    tokenizer: object = None  # the host's, prepared (pad token, left padding): the run uses this one


def _limit(features: list[dict], max_length: int | None, policy: str) -> tuple[list[dict], dict]:
    """`--max-length` with `--over-length`: the records kept and the counts."""
    over = [f for f in features if max_length is not None and len(f["input_ids"]) > max_length]
    counts = {"records": len(features), "over_max_length": len(over), "truncated": 0, "dropped": 0,
              "longest": max((len(f["input_ids"]) for f in features), default=0)}
    if not over:
        return features, counts
    kept = []
    for f in features:
        if len(f["input_ids"]) <= max_length:
            kept.append(f)
        elif policy == "truncate" and any(t != IGNORE_INDEX for t in f["labels"][:max_length]):
            cut = {**f, "input_ids": f["input_ids"][:max_length], "labels": f["labels"][:max_length]}
            cut.pop("target", None)  # its target no longer fits: no generation check
            kept.append(cut)
            counts["truncated"] += 1
        else:
            counts["dropped"] += 1
    return kept, counts


def load_own_data(cfg, tokenizer, source: str, world_size: int, log) -> OwnData:
    """Read, check and tokenize `cfg.dataset` (UsageError on any problem, before the run writes anything)."""
    raw = read_dataset(cfg.dataset)
    empty = [name for name, split in raw.items() if not split.rows]
    if empty:
        raise UsageError(f"--dataset {cfg.dataset}: the {', '.join(empty)} split is empty")
    if "train" not in raw:
        raise UsageError(f"--dataset {cfg.dataset}: no train split (splits found: {', '.join(raw)})")
    fmt = detect_format(cfg.dataset, raw)
    prepare_tokenizer(tokenizer, fmt, source)
    encoded = {}
    for name, split in raw.items():
        feats = [encode(tokenizer, fmt, r, p) for r, p in zip(split.rows, split.places)]
        for f in feats:
            f["attention_mask"] = [1] * len(f["input_ids"])
        encoded[name] = feats
    if len(encoded) == 1:  # a seeded hold-out
        order = list(range(len(encoded["train"])))
        random.Random(cfg.data_seed).shuffle(order)
        k = max(1, round(cfg.eval_ratio * len(order)))
        if k >= len(order):
            raise UsageError(f"--dataset {cfg.dataset}: {len(order)} record(s) cannot be split into train and a "
                             f"--eval-ratio {cfg.eval_ratio} hold-out; add records")
        train = encoded["train"]
        encoded = {"train": [train[i] for i in sorted(order[k:])], "validation": [train[i] for i in sorted(order[:k])]}
    report, kept = {}, {}
    for name, feats in encoded.items():
        kept[name], report[name] = _limit(feats, cfg.max_length, cfg.over_length)
        if not kept[name]:
            raise UsageError(f"--dataset {cfg.dataset}: every record of the {name} split ({len(feats)}) is over "
                             f"--max-length {cfg.max_length} tokens (the longest has {report[name]['longest']})"
                             + ("" if cfg.over_length == "truncate" else "; raise it or pass --over-length truncate"))
        if name != "train" and cfg.max_eval_examples is not None:
            kept[name] = kept[name][:cfg.max_eval_examples]
        report[name]["used"] = len(kept[name])
    if len(kept["train"]) < cfg.batch_size * world_size:
        raise UsageError(f"--dataset {cfg.dataset}: {len(kept['train'])} training records are fewer than one global "
                         f"batch of {cfg.batch_size} x {world_size} processes; lower --batch-size")
    for name, r in report.items():
        extra = (f"; {r['over_max_length']} over --max-length {cfg.max_length}: {r['truncated']} truncated, "
                 f"{r['dropped']} dropped") if r["over_max_length"] else ""
        log(f"data {cfg.dataset} ({FORMATS[fmt]}): {name} {r['records']:,} records, {r['used']:,} used{extra}")
    return OwnData(cfg.dataset, fmt, Encoded(kept["train"]),
                   {k: Encoded(v) for k, v in kept.items() if k != "train"}, report, tokenizer)


# ---------------------------------------------------------------- evaluation

class OwnEvalSet:
    """One eval split with a prepared (sharded) loader over length-sorted indices."""

    def __init__(self, accelerator, name: str, data: Encoded, batch_size: int):
        self.name, self.data = name, data
        order = sorted(range(len(data)), key=lambda i: len(data.features[i]["input_ids"]))
        loader = torch.utils.data.DataLoader(order, batch_size=batch_size, collate_fn=torch.tensor)
        self.loader = accelerator.prepare_data_loader(loader)


@torch.no_grad()
def evaluate_own(accelerator, model, tokenizer, evalset: OwnEvalSet, generate: bool) -> dict:
    """Loss and perplexity over the split's scored tokens, token accuracy, and with `generate` the exact match of
    the greedy completion (prompt-completion and conversational data: the generated ids equal the target's, its
    EOS or end-of-turn included), on every process."""
    from llm_surgery.box_data import BoxCollator

    from .evaluate import completion_loss_inputs, completion_span

    collate = BoxCollator(tokenizer, padding_side="left")
    was_training = model.training
    model.eval()
    rows = []
    try:
        for idx in evalset.loader:
            feats = [evalset.data.features[i] for i in idx.tolist()]
            cpu = collate([{k: f[k] for k in ("input_ids", "attention_mask", "labels")} for f in feats])
            span = completion_span(cpu["labels"])
            batch = {k: v.to(accelerator.device) for k, v in cpu.items()}
            with accelerator.autocast():
                logits, labels = completion_loss_inputs(model, batch, span)
            mask = labels != IGNORE_INDEX
            nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels.clamp(min=0),
                                                    reduction="none")
            row = torch.stack([(nll * mask).sum(-1), mask.sum(-1).double(),
                               ((logits.argmax(-1) == labels) & mask).sum(-1).double(),
                               _exact(accelerator, model, tokenizer, feats, collate) if generate
                               else torch.full((len(feats),), -1.0, device=accelerator.device, dtype=torch.double)],
                              -1).double()
            rows.append(accelerator.gather_for_metrics(row).cpu())
    finally:
        model.train(was_training)
    table = torch.cat(rows) if rows else torch.zeros(0, 4, dtype=torch.double)
    tokens = float(table[:, 1].sum())
    loss = float(table[:, 0].sum()) / tokens if tokens else float("nan")
    out = {"num_examples": len(table), "num_tokens": int(tokens), "loss": loss,
           "perplexity": math.exp(loss) if loss < 700 else float("inf"),
           "token_accuracy": float(table[:, 2].sum()) / tokens if tokens else None}
    checked = table[table[:, 3] >= 0, 3]
    if generate and len(checked):
        out["exact_match"] = float(checked.mean())
        out["num_generated"] = len(checked)
    return out


def _exact(accelerator, model, tokenizer, feats: list[dict], collate) -> torch.Tensor:
    """1 where greedy decoding from the prompt gives exactly the target ids, 0 where not, -1 where a record has no
    target (language modelling, or truncated). `collate`: the evaluation's left-padding collator."""
    out = torch.full((len(feats),), -1.0, dtype=torch.double, device=accelerator.device)
    todo = [i for i, f in enumerate(feats) if f.get("target")]
    if not todo:
        return out
    batch = collate([{"input_ids": feats[i]["prompt"]} for i in todo])
    longest = max(len(feats[i]["target"]) for i in todo)
    with accelerator.autocast():
        generated = accelerator.unwrap_model(model).generate(
            input_ids=batch["input_ids"].to(accelerator.device),
            attention_mask=batch["attention_mask"].to(accelerator.device), max_new_tokens=longest, do_sample=False,
            num_beams=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = generated[:, batch["input_ids"].shape[1]:].tolist()
    for row, i in zip(new, todo):
        target = feats[i]["target"]
        out[i] = float(row[:len(target)] == target)
    return out


def results_table(evals: dict, host_alone: dict | None, title: str):
    """A rich Table: one row per eval split, loss / perplexity / token accuracy / exact match, the host alone
    beside the host with the inserted layers."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("split", no_wrap=True)
    table.add_column("examples", justify="right")
    metrics = (("loss", "loss", "{:.4f}"), ("ppl", "perplexity", "{:.3f}"), ("token %", "token_accuracy", "{:.1%}"),
               ("exact %", "exact_match", "{:.1%}"))
    metrics = [m for m in metrics if any(m[1] in e for e in evals.values())]
    for name, _, _ in metrics:
        if host_alone:
            table.add_column(f"{name}\nhost alone", justify="right")
        table.add_column(f"{name}\n+layers" if host_alone else name, justify="right")

    def cell(part, key, fmt):
        v = (part or {}).get(key)
        return "-" if v is None else fmt.format(v).rstrip("%") if fmt.endswith("%}") else fmt.format(v)

    for split, part in evals.items():
        cells = []
        for _, key, fmt in metrics:
            if host_alone:
                cells.append(cell(host_alone.get(split), key, fmt))
            cells.append(cell(part, key, fmt))
        table.add_row(split, str(part["num_examples"]), *cells)
    return table
