"""Sample Box worlds and operation sequences, and turn them into prompt/completion records.

A "state transition" is one operation in the context (a global count). Each sampled sequence of `max_ops`
operations yields one record per prefix length 0..max_ops and per box, so every split is exactly uniform over
`num_ops`. Train, validation and test never share an initial arrangement of per-box object counts: the
4**7 count signatures are shuffled (from the seed alone) and cut 60/10/30 into three disjoint sets, and a
split only keeps sequences whose initial signature lies in its own set. Every split draws from its own random
stream (seeded by `seed` and the split name), so e.g. the test set does not change when the train size does.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .vocab import COMMON_OBJECTS, RARE_OBJECTS

NUM_BOXES = 7
MAX_PER_BOX = 3
INITIAL_MEAN = 2.0  # initial count per box ~ Poisson(2), clipped at MAX_PER_BOX
PUT_MEAN = 1.0  # objects per put ~ Poisson(1), redrawn when 0
SPLITS = ("train", "validation", "test")
DISJOINT_SPLIT = "test_disjoint_vocab"
# Share of the count signatures given to each split; fixed so that the partition depends on the seed only.
SIGNATURE_FRACTIONS = {"train": 0.6, "validation": 0.1, "test": 0.3}
DEFAULT_SEED = 2255
DEFAULT_NUM_SEQUENCES = 1000
DEFAULT_TRAIN_MAX_OPS = 6
DEFAULT_TEST_MAX_OPS = 26

State = tuple[tuple[str, ...], ...]  # per box, its objects sorted alphabetically


@dataclass(frozen=True)
class Operation:
    action: str  # "move", "remove" or "put"
    objects: tuple[str, ...]  # sorted
    source: int | None  # box emptied from (move, remove)
    target: int | None  # box filled (move, put)

    def changed_boxes(self) -> set[int]:
        return {b for b in (self.source, self.target) if b is not None}


# ---------------------------------------------------------------- text

def describe_objects(objects: Sequence[str]) -> str:
    return " and ".join(f"the {o}" for o in sorted(objects))


def box_clause(box: int, objects: Sequence[str]) -> str:
    return f"Box {box} contains {describe_objects(objects)}" if objects else f"Box {box} is empty"


def completion(objects: Sequence[str]) -> str:
    """The target after the query `Box k`: ` contains the X and the Y` or ` is empty`."""
    return f" contains {describe_objects(objects)}" if objects else " is empty"


def describe_state(state: State) -> str:
    return ", ".join(box_clause(b, objs) for b, objs in enumerate(state)) + "."


def operation_sentence(op: Operation) -> str:
    content = describe_objects(op.objects)
    if op.action == "move":
        return f"Move {content} from Box {op.source} to Box {op.target}."
    if op.action == "remove":
        return f"Remove {content} from Box {op.source}."
    return f"Put {content} into Box {op.target}."


# ---------------------------------------------------------------- sampling

def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's multiplication method; exact and deterministic for the small means used here."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def sample_initial_state(rng: random.Random, vocab: Sequence[str]) -> State:
    counts = [min(_poisson(rng, INITIAL_MEAN), MAX_PER_BOX) for _ in range(NUM_BOXES)]
    drawn = rng.sample(list(vocab), sum(counts))
    state, start = [], 0
    for c in counts:
        state.append(tuple(sorted(drawn[start:start + c])))
        start += c
    return tuple(state)


def signature(state: State) -> str:
    """Per-box object counts, e.g. "2031302": the key of the split rule."""
    return "".join(str(len(objs)) for objs in state)


def _nonempty_subset(rng: random.Random, objects: Sequence[str]) -> tuple[str, ...]:
    while True:
        subset = tuple(o for o in objects if rng.random() < 0.5)
        if subset:
            return subset


def sample_operation(rng: random.Random, state: State, vocab: Sequence[str]) -> Operation:
    """Uniform type and box; an impossible or over-capacity draw is redrawn from scratch."""
    while True:
        action = rng.choice(("move", "remove", "put"))
        box = rng.randrange(NUM_BOXES)
        if action in ("move", "remove"):
            if not state[box]:
                continue
            subset = _nonempty_subset(rng, state[box])
            if action == "remove":
                return Operation("remove", subset, box, None)
            target = rng.choice([b for b in range(NUM_BOXES) if b != box])
            if len(state[target]) + len(subset) > MAX_PER_BOX:
                continue
            return Operation("move", subset, box, target)
        n = _poisson(rng, PUT_MEAN)
        if n == 0 or len(state[box]) + n > MAX_PER_BOX:
            continue
        used = {o for objs in state for o in objs}
        void = [o for o in vocab if o not in used]
        if n > len(void):
            continue
        return Operation("put", tuple(sorted(rng.sample(void, n))), None, box)


def apply_operation(state: State, op: Operation) -> State:
    boxes = [set(objs) for objs in state]
    if op.source is not None:
        boxes[op.source] -= set(op.objects)
    if op.target is not None:
        boxes[op.target] |= set(op.objects)
    return tuple(tuple(sorted(b)) for b in boxes)


# ---------------------------------------------------------------- records

def sequence_records(initial: State, ops: Sequence[Operation], sequence_id: str, split: str) -> list[dict]:
    """One record per prefix length and per box (see the module docstring)."""
    records, state = [], initial
    changes = [0] * NUM_BOXES
    prefix = describe_state(initial)
    sig = signature(initial)
    for num_ops in range(len(ops) + 1):
        if num_ops:
            op = ops[num_ops - 1]
            state = apply_operation(state, op)
            for b in op.changed_boxes():
                changes[b] += 1
            prefix = f"{prefix} {operation_sentence(op)}"
        for box in range(NUM_BOXES):
            records.append({
                "id": f"{sequence_id}/{num_ops:02d}/{box}",
                "context": f"{prefix} Box {box}",
                "target": completion(state[box]),
                "objects": list(state[box]),
                "num_ops": num_ops,
                "box": box,
                "num_ops_box": changes[box],
                "sequence_id": sequence_id,
                "split": split,
                "signature": sig,
            })
    return records


def signature_partition(seed: int) -> dict[str, frozenset[str]]:
    """Shuffle all (MAX_PER_BOX+1)**NUM_BOXES count signatures and cut them by SIGNATURE_FRACTIONS."""
    sigs = ["".join(map(str, c)) for c in itertools.product(range(MAX_PER_BOX + 1), repeat=NUM_BOXES)]
    random.Random(f"{seed}/signatures").shuffle(sigs)
    parts, start = {}, 0
    for i, split in enumerate(SPLITS):
        stop = len(sigs) if i == len(SPLITS) - 1 else start + round(SIGNATURE_FRACTIONS[split] * len(sigs))
        parts[split] = frozenset(sigs[start:stop])
        start = stop
    return parts


def generate_split(split: str, num_sequences: int, max_ops: int, seed: int = DEFAULT_SEED,
                   vocab: Sequence[str] = COMMON_OBJECTS, signatures: frozenset[str] | None = None,
                   progress: bool = False) -> list[dict]:
    """`num_sequences` sequences of `max_ops` operations -> num_sequences * (max_ops+1) * 7 records.

    `signatures` restricts initial count signatures (default: the split's own set; "test_disjoint_vocab" uses
    the test set). Exact duplicate initial states are skipped.
    """
    _check_count("num_sequences", num_sequences)
    _check_count("max_ops", max_ops)
    if signatures is None:
        signatures = signature_partition(seed)["test" if split == DISJOINT_SPLIT else split]
    if num_sequences and not signatures:
        raise ValueError(f"split {split!r} has no allowed initial signatures")
    rng = random.Random(f"{seed}/{split}")
    seen: set[State] = set()
    records: list[dict] = []
    bar = _progress_bar(num_sequences, f"{split} sequences") if progress else None
    while len(seen) < num_sequences:
        initial = sample_initial_state(rng, vocab)
        if signature(initial) not in signatures or initial in seen:
            continue
        seen.add(initial)
        state, ops = initial, []
        for _ in range(max_ops):
            op = sample_operation(rng, state, vocab)
            ops.append(op)
            state = apply_operation(state, op)
        records.extend(sequence_records(initial, ops, f"{split}-{len(seen) - 1:06d}", split))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return records


def split_sizes(num_sequences: int | Mapping[str, int]) -> dict[str, int]:
    """Sequences per split: an int total is cut by SIGNATURE_FRACTIONS (largest remainder); a mapping is taken
    as is (missing splits get 0)."""
    if isinstance(num_sequences, Mapping):
        unknown = set(num_sequences) - set(SPLITS)
        if unknown:
            raise ValueError(f"num_sequences has unknown splits {sorted(unknown)}; expected keys from {SPLITS}")
        sizes = {s: num_sequences.get(s, 0) for s in SPLITS}
        for s, n in sizes.items():
            _check_count(f"num_sequences[{s!r}]", n)
        return sizes
    _check_count("num_sequences", num_sequences)
    exact = {s: SIGNATURE_FRACTIONS[s] * num_sequences for s in SPLITS}
    sizes = {s: int(v) for s, v in exact.items()}
    for s in sorted(SPLITS, key=lambda s: sizes[s] - exact[s])[: num_sequences - sum(sizes.values())]:
        sizes[s] += 1
    return sizes


def check_generation_args(num_sequences, seed, train_max_ops, test_max_ops) -> dict[str, int]:
    """Validate everything up front (before any work); returns the sequences per split."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    _check_count("train_max_ops", train_max_ops)
    _check_count("test_max_ops", test_max_ops)
    if test_max_ops < train_max_ops:
        raise ValueError(f"test_max_ops ({test_max_ops}) must be >= train_max_ops ({train_max_ops})")
    sizes = split_sizes(num_sequences)
    if not any(sizes.values()):
        raise ValueError(f"num_sequences must be at least 1 in some split, got {num_sequences!r}: nothing to generate")
    return sizes


def generate_splits(num_sequences: int | Mapping[str, int] = DEFAULT_NUM_SEQUENCES, seed: int = DEFAULT_SEED,
                    train_max_ops: int = DEFAULT_TRAIN_MAX_OPS, test_max_ops: int = DEFAULT_TEST_MAX_OPS,
                    disjoint_vocab: bool = False, progress: bool = False) -> dict[str, list[dict]]:
    """Build train/validation (0..train_max_ops ops) and test (0..test_max_ops ops) records in memory.

    With the defaults: 600/100/300 sequences -> 29,400 train, 4,900 validation and 56,700 test records.
    `disjoint_vocab` adds "test_disjoint_vocab": as many test sequences again, drawn with RARE_OBJECTS.
    """
    sizes = check_generation_args(num_sequences, seed, train_max_ops, test_max_ops)
    parts = signature_partition(seed)
    max_ops = {"train": train_max_ops, "validation": train_max_ops, "test": test_max_ops}
    out = {s: generate_split(s, sizes[s], max_ops[s], seed, COMMON_OBJECTS, parts[s], progress) for s in SPLITS}
    if disjoint_vocab:
        out[DISJOINT_SPLIT] = generate_split(DISJOINT_SPLIT, sizes["test"], test_max_ops, seed, RARE_OBJECTS,
                                             parts["test"], progress)
    return out


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="seq")
