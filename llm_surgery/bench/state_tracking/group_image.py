"""What a learned Flash PD-SSM dictionary does on a group word problem.

A head tracks a group G exactly when the state map its tokens select depends only on the product of the word read
so far: the maps then form a homomorphic image of G (the "tracked quotient"). For S3 that image is S3 itself
(6 maps), its sign (2 maps: only odd against even) or nothing (1 map); A5 is simple, so a head tracks all 60 elements
or none, and needs a dictionary of at least 60 members to do so (one member per element: each token selects one
member). `summary(model, task)` finds, per head of the first layer, whether its maps are consistent with G and the
size of their image, by walking the (group element, state map) pairs that words reach, and how many tokens'
maps are the group's natural action on the head's N entries (a near miss shows as all tokens but one).

Only the first layer of a model whose Flash PD-SSM layer has no convolution (`conv_kernel=1`, the one-layer
recipes) selects its transition from the current token alone; other models are refused.
"""

from __future__ import annotations

import functools
import itertools

import torch

from ...layers import FlashPDSSM
from .tasks import GROUPS, Task, group_word_problem


def _token_driven(model) -> bool:
    """The first layer is a Flash PD-SSM without convolution: each transition depends on its token alone."""
    mixer = model.blocks[0].mixer
    return isinstance(mixer, FlashPDSSM) and mixer.conv1d.kernel_size[0] == 1


def readable(model, task: Task) -> bool:
    """Whether `summary` applies: a group word problem and a token-driven first layer."""
    return task.name.split("_")[0] in GROUPS and _token_driven(model)


def token_transitions(model, task: Task) -> torch.Tensor:
    """[H, S, N] destinations: the state map that symbol token s selects in head h of the first layer."""
    if not _token_driven(model):
        raise ValueError("group_image needs a first layer of kind pdssm with conv_kernel=1 (its transition then "
                         "depends on the current token only)")
    mixer, captured = model.blocks[0].mixer, {}

    def capture(u, attention_mask):
        captured["kstar"] = mixer._ssm_inputs(u)[0].argmax(-1)[0]      # [H, S]

    with mixer.watching_inputs(capture), torch.no_grad():
        model(torch.arange(task.num_symbols, device=next(model.parameters()).device)[None])
    P = mixer.transitions().long()                                      # [H, K, N]
    return torch.gather(P, 1, captured["kstar"][..., None].expand(-1, -1, P.shape[-1]).long()).cpu()


def head_image(P: torch.Tensor, elements: list[int], table: torch.Tensor) -> int | None:
    """The size of the image of G under one head's token maps P [S, N], or None where the head's state map is not a
    function of the group element (two words with the same product reach different maps)."""
    maps = [tuple(p.tolist()) for p in P]
    start = tuple(range(P.shape[-1]))
    seen = {0: start}                                   # group element (0 = identity) -> the state map reached
    todo = [0]
    while todo:
        g = todo.pop()
        where = seen[g]
        for s, e in enumerate(elements):
            h = int(table[e, g])                         # the symbol's element applied after g
            nxt = tuple(maps[s][m] for m in where)       # entry m, at where[m], moves on to maps[s][where[m]]
            if h not in seen:
                seen[h] = nxt
                todo.append(h)
            elif seen[h] != nxt:
                return None
    return len(set(seen.values()))


def natural_agreement(P: torch.Tensor, elements: list[int], perms: list[tuple[int, ...]]) -> int | None:
    """How many tokens' maps P [S, N] are the group's natural action on N points (each element permuting the points
    as itself), under the best relabelling of the N state entries; None where N is not the group's degree. A head
    one token short of all is a near miss that a straight-through gradient has to leave by moving that token to
    another member."""
    if P.shape[-1] != len(perms[0]):
        return None
    maps = [tuple(p.tolist()) for p in P]
    candidates = _relabelled_actions(tuple(elements), tuple(perms))
    return max(sum(a == b for a, b in zip(maps, natural)) for natural in candidates)


@functools.lru_cache(maxsize=None)
def _relabelled_actions(elements: tuple[int, ...], perms: tuple[tuple[int, ...], ...]) -> list[list[tuple[int, ...]]]:
    """The tokens' natural maps under every relabelling sigma of the entries (entry sigma[i] holds point i): the same
    for every head, so computed once per task."""
    n = len(perms[0])
    out = []
    for sigma in itertools.permutations(range(n)):
        natural = []
        for e in elements:
            q = [0] * n
            for i in range(n):
                q[sigma[i]] = sigma[perms[e][i]]
            natural.append(tuple(q))
        out.append(natural)
    return out


def summary(model, task: Task) -> dict:
    """Per head of the first layer: the tracked image's size (`images`; None: no function of the group) and the
    tokens it maps as the natural action (`natural_tokens`, of `symbols`); the heads that track the whole group
    (`faithful`) or a quotient between it and the trivial one, the largest image and the closest head."""
    perms, elements, table = group_word_problem(task.name)
    order = table.shape[0]
    P_all = token_transitions(model, task)
    images = [head_image(P, elements, table) for P in P_all]
    natural = [natural_agreement(P, elements, perms) for P in P_all]
    tracked = [i for i in images if i is not None]
    return {"images": images, "group_order": order, "faithful": sum(i == order for i in tracked),
            "quotient": sum(1 < i < order for i in tracked), "largest": max(tracked, default=0),
            "natural_tokens": natural, "symbols": len(elements),
            "closest": max((a for a in natural if a is not None), default=None)}
