"""Score predicted completions: exact match with the order of objects ignored (as the original metric).

A completion is read as ` is empty` (no objects) or ` contains the X and the Y ...` (a multiset of objects;
a missing "the" is tolerated, as the original strips it). Leading/trailing space, a final "." and anything
after the first "." or newline are ignored. Whole-state accuracy groups the records by
(`sequence_id`, `num_ops`) and needs every box right; only groups holding all boxes are counted.

Predictions are joined to records by `id` (a mapping): every record needs exactly one prediction and every
prediction a record, else a ValueError names the first id concerned. A plain list is aligned by position, and only
where the counts match; the CLI uses that form only when no line of the predictions file carries an id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from .generate import DEFAULT_TRAIN_MAX_OPS, NUM_BOXES


def parse_completion(text: str) -> tuple[str, ...] | None:
    """Sorted objects of a completion, () for "is empty", None if it is neither form."""
    words = text.split("\n", 1)[0].split(".", 1)[0].split()
    if words == ["is", "empty"]:
        return ()
    if len(words) < 2 or words[0] != "contains":
        return None
    objects = []
    for item in " ".join(words[1:]).split(" and "):
        item = item.split()
        if item and item[0] == "the":
            item = item[1:]
        if len(item) != 1:
            return None
        objects.append(item[0])
    return tuple(sorted(objects))


def is_correct(prediction: str, target: str) -> bool:
    gold = parse_completion(target)
    if gold is None:
        raise ValueError(f"target {target!r} is not a Box completion")
    return parse_completion(prediction) == gold


RECORD_FIELDS = ("target", "sequence_id", "num_ops", "box", "num_ops_box")


def check_records(records: Sequence[Mapping], need_id: bool = False) -> None:
    """A ValueError naming the record (1-based) and field for a record the scorer cannot use."""
    for i, r in enumerate(records, 1):
        if not isinstance(r, Mapping):
            raise ValueError(f"record {i}: expected a JSON object, got {type(r).__name__}")
        missing = [f for f in RECORD_FIELDS + (("id",) if need_id else ()) if f not in r]
        if missing:
            name = f" (id {r['id']!r})" if "id" in r else ""
            raise ValueError(f"record {i}{name}: missing field {', '.join(map(repr, missing))}")
        if not isinstance(r["target"], str):
            raise ValueError(f"record {i}: field 'target' must be a string, got {type(r['target']).__name__}")


def _align(records: Sequence[Mapping], predictions) -> list[str]:
    if isinstance(predictions, Mapping):
        check_records(records, need_id=True)
        ids = [r["id"] for r in records]
        first = {}
        for i, rid in enumerate(ids, 1):
            if rid in first:
                raise ValueError(f"records {first[rid]} and {i} share the id {rid!r}: predictions cannot be joined")
            first[rid] = i
        missing = [rid for rid in ids if rid not in predictions]
        if missing:
            raise ValueError(f"{len(missing)} record(s) have no prediction (first: id {missing[0]!r})")
        unknown = [pid for pid in predictions if pid not in first]
        if unknown:
            raise ValueError(f"{len(unknown)} prediction(s) have an id that is in no record (first: {unknown[0]!r})")
        preds = [predictions[rid] for rid in ids]
        where = [f"for id {rid!r}" for rid in ids]
    else:
        preds = list(predictions)
        if len(preds) != len(records):
            raise ValueError(f"got {len(preds)} predictions for {len(records)} records (a list is aligned by "
                             "position; give a mapping from record id to prediction to join on id)")
        where = [f"{i}" for i in range(1, len(preds) + 1)]
    for p, w in zip(preds, where):
        if not isinstance(p, str):
            raise TypeError(f"prediction {w} must be a string, got {type(p).__name__}")
    return preds


def _summary(correct: list[bool], states: list[bool]) -> dict:
    return {
        "num_examples": len(correct),
        "accuracy": sum(correct) / len(correct) if correct else None,
        "num_states": len(states),
        "state_accuracy": sum(states) / len(states) if states else None,
    }


def score(records: Sequence[Mapping], predictions, train_max_ops: int = DEFAULT_TRAIN_MAX_OPS) -> dict:
    """Accuracy overall, per `num_ops`, per `num_ops_box`, IID (num_ops <= train_max_ops) and OOD (above).

    `predictions`: a mapping from record `id` to completion (joined on id: missing, unknown or duplicate ids are
    errors), or a list of completions aligned with `records` by position (counts must match).
    Each group reports num_examples, accuracy, num_states and state_accuracy (None where empty).
    """
    check_records(records)
    preds = _align(records, predictions)
    correct = [is_correct(p, r["target"]) for p, r in zip(preds, records)]
    groups: dict[tuple, dict[int, bool]] = defaultdict(dict)
    for ok, r in zip(correct, records):
        groups[(r["sequence_id"], r["num_ops"])][r["box"]] = ok
    state_ok = {k: all(v.values()) for k, v in groups.items() if len(v) == NUM_BOXES}

    def pick(keep_example, keep_state):
        return ([ok for ok, r in zip(correct, records) if keep_example(r)],
                [ok for k, ok in state_ok.items() if keep_state(k[1])])

    result = _summary(correct, list(state_ok.values()))
    result["iid"] = _summary(*pick(lambda r: r["num_ops"] <= train_max_ops, lambda n: n <= train_max_ops))
    result["ood"] = _summary(*pick(lambda r: r["num_ops"] > train_max_ops, lambda n: n > train_max_ops))
    result["by_num_ops"] = {n: _summary(*pick(lambda r, n=n: r["num_ops"] == n, lambda m, n=n: m == n))
                            for n in sorted({r["num_ops"] for r in records})}
    by_box = defaultdict(list)
    for ok, r in zip(correct, records):
        by_box[r["num_ops_box"]].append(ok)
    result["by_num_ops_box"] = {n: {"num_examples": len(v), "accuracy": sum(v) / len(v)}
                                for n, v in sorted(by_box.items())}
    result["train_max_ops"] = train_max_ops
    return result
