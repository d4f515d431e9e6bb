"""What do inserted Flash PD-SSM layers do on real inputs? `SelectionProbe(model)`, used as a context manager around
an evaluation, records for every inserted pdssm mixer which dictionary member each token selects and how long its
state entries remember (|D_t|), over the real tokens only; `summary()` turns that into a few numbers per layer:

  members used      members taking at least 1% of a head's tokens (mean over heads), and the top member's share
  entropy           selection entropy in bits, against log2(K) for a uniform use of the dictionary
  permutations      the share of selections whose member is a permutation (N distinct destinations), and of
                    those that are the identity (a diagonal step); merging members have fewer destinations
  half-life         ln 0.5 / ln |D_t| in tokens, median over (token, entry), and the share of entries that keep
                    half of their value for 64 tokens or more (about the span of a Box example)
  surviving         how many of the N entries of a state keep apart through the selected maps: the image size
                    of their composition over 16 tokens and over a whole sequence (mean over sequences and heads;
                    N for permutations, fewer when members merge entries: then what they held is summed)

A layer that always selects one member, or only identities, is a diagonal SSM on that task; one whose entries
halve within a few tokens cannot carry a box's content across the operations that follow it."""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch

from ..ops.pd_select.function import gather_transitions
from .surgery import inserted_layers

# half-life bins in tokens: [0, 1), [1, 2), [2, 4), ... [64, 128), [128, inf)
_EDGES = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])


def _image_size(where: torch.Tensor) -> torch.Tensor:
    """Distinct values along the last dim: [..., N] -> [...]."""
    v = where.sort(-1).values
    return (v[..., 1:] != v[..., :-1]).sum(-1) + 1


class SelectionProbe:
    """Context manager: within it, each inserted pdssm mixer's forward also records its selections and decays (one
    extra pass over its transition inputs, on the torch path). The mixers are restored on exit, also after an
    error. Refuses a model without inserted pdssm layers."""

    def __init__(self, model):
        self.blocks = {i: b for i, b in inserted_layers(model).items() if b.kind == "pdssm"}
        if not self.blocks:
            raise ValueError("SelectionProbe: the model has no inserted pdssm layers")
        self.counts, self.halflife, self.surviving = {}, {}, {}

    def __enter__(self):
        with ExitStack() as watching:   # (an error part-way leaves no mixer watched)
            for i, block in self.blocks.items():
                mixer = block.mixer
                H, K = mixer.num_heads, mixer.dict_size
                self.counts[i] = torch.zeros(H, K, dtype=torch.float64)
                self.halflife[i] = torch.zeros(H, len(_EDGES) + 1, dtype=torch.float64)
                self.surviving[i] = torch.zeros(3, dtype=torch.float64)   # sum over 16 tokens, over sequences, count
                watching.enter_context(mixer.watching_inputs(self._recording(i, mixer)))
            self._watching = watching.pop_all()
        return self

    def __exit__(self, *exc):
        self._watching.close()
        return False

    def _recording(self, i, mixer):
        def run(u, attention_mask):
            with torch.no_grad():
                sel, D, _, _ = mixer._ssm_inputs(u)
                kstar = sel.argmax(-1)                                      # [B, H, L]
                half = (math.log(0.5) / D.abs().clamp(1e-30, 1 - 1e-12).log()).contiguous()   # [B,H,L,N] tokens
                keep = (torch.ones(kstar.shape[0], kstar.shape[2], dtype=torch.bool, device=kstar.device)
                        if attention_mask is None else attention_mask.to(torch.bool))
                keep = keep[:, None, :].expand_as(kstar)                    # [B, H, L]
                H, K = self.counts[i].shape
                heads = torch.arange(H, device=kstar.device).view(1, H, 1).expand_as(kstar)
                self.counts[i] += torch.bincount((heads * K + kstar)[keep], minlength=H * K).view(H, K).double().cpu()
                bins = torch.bucketize(half, _EDGES.to(half.device), right=True)   # [B, H, L, N]
                hb = heads.unsqueeze(-1).expand_as(bins)
                nb = len(_EDGES) + 1
                ok = keep.unsqueeze(-1).expand_as(bins)
                self.halflife[i] += torch.bincount((hb * nb + bins)[ok], minlength=H * nb).view(H, nb).double().cpu()
                P = gather_transitions(mixer.transitions(), kstar, attention_mask).long()   # [B, H, L, N]
                where = torch.arange(P.shape[-1], device=P.device).expand(P.shape[0], H, -1)  # entry m is at where[m]
                first = None
                for t in range(P.shape[2]):
                    where = torch.gather(P[:, :, t], -1, where)
                    if t == min(15, P.shape[2] - 1):
                        first = _image_size(where)
                self.surviving[i] += torch.tensor([float(first.sum()), float(_image_size(where).sum()),
                                                   first.numel()], dtype=torch.float64)
        return run

    def summary(self) -> dict:
        """Per inserted layer (decoder index): the numbers the module docstring lists."""
        out = {}
        for i, block in self.blocks.items():
            counts, hl = self.counts[i], self.halflife[i]
            tokens = counts.sum(1, keepdim=True)
            if float(tokens.sum()) == 0:
                out[i] = {"tokens": 0}
                continue
            share = counts / tokens.clamp_min(1)
            P = block.mixer.transitions().long().cpu()                      # [H, K, N] destinations
            N = P.shape[-1]
            distinct = torch.tensor([[len(set(P[h, k].tolist())) for k in range(P.shape[1])]
                                     for h in range(P.shape[0])], dtype=torch.float64)
            identity = (P == torch.arange(N)).all(-1).double()
            entropy = -(share * share.clamp_min(1e-30).log2()).sum(1)
            cum = hl.sum(0).cumsum(0) / hl.sum()
            median_bin = int((cum >= 0.5).nonzero()[0])
            bounds = [0.0, *_EDGES.tolist(), math.inf]
            out[i] = {
                "tokens": int(tokens.sum() / counts.shape[0]),
                "members_used": float((share >= 0.01).sum(1).double().mean()),
                "top_member_share": float(share.max(1).values.mean()),
                "entropy_bits": float(entropy.mean()), "max_entropy_bits": math.log2(counts.shape[1]),
                "permutation_share": float((share * (distinct == N)).sum(1).mean()),
                "identity_share": float((share * identity).sum(1).mean()),
                "mean_destinations": float((share * distinct).sum(1).mean()), "state_size": N,
                "halflife_median_tokens": [bounds[median_bin], bounds[median_bin + 1]],
                "halflife_64_share": float(hl[:, -2:].sum() / hl.sum()),
                "surviving_16_tokens": float(self.surviving[i][0] / self.surviving[i][2]),
                "surviving_sequence": float(self.surviving[i][1] / self.surviving[i][2]),
            }
        return out
