"""The trainer's forward and backward, replayed from CUDA graphs (`--cuda-graphs`, on by default on CUDA).

At the recipes' batch (8 Box examples of ~100 tokens) a frozen 3B host's step is bound by the CPU's kernel
launches, not by the GPU: the granite3b recipe on a random-weight granite-4.0-h-micro with 4 pdssm layers took
341 ms a step eagerly (335 of them issuing kernels) and 83 ms replayed, 2,291 against 9,560 tokens/s (one H100;
4 H100s graphed: 90% of that per GPU; BENCHMARKS.md). Here each micro-batch's forward and backward is one graph per batch shape
(`llm_surgery.cuda_graphs`), and so that a few graphs serve a run:
- batches are padded (left, masked) to a multiple of LENGTH_MULTIPLE tokens, and the scored span (the positions
  the LM head runs on) is rounded up to a multiple of SPAN_MULTIPLE; the extra positions hold padding or prompt
  tokens whose labels are ignored, so the loss is the same. On the recipes' Box data (1,000 sequences, word
  tokenizer) that is 3 shapes, two of them 97% of the batches, for 9% more tokens than padding to 8;
- gradients accumulate into one flat buffer per dtype that the trainable tensors' `.grad` view: the graph's
  backward adds into them and `zero_grad` clears them before a step (the graph keeps their addresses, so they are
  never set to None);
- the model is not wrapped by Accelerate (no DDP, no autocast wrapper): with the model inside DDP the capture
  failed on 2 H100s (likely DDP's reducer hooks, which run inside the backward). With several processes
  `all_reduce` averages the flat buffers instead, one call per buffer after the last micro-batch: nothing
  overlaps the backward, but the trainable tensors are few (135 M on a 3B host: 9 ms a step on 4 H100s, the wait
  for the slowest rank included, against an 83 ms step). Every process starts from rank 0's weights, as DDP
  would make it (`broadcast_trainable`);
- the straight-through temperature is read from device memory (`FlashPDSSM.tau_held`), so annealing works;
- every shape the run will meet is captured before its first step (`run_shapes`, `GraphedLoss.prepare`: the
  sampler fixes the order, so the shapes are known), most frequent first, at most MAX_PREPARED of them; a shape
  met only later is run eagerly once, then captured. Captured lazily, a new shape stalls its step twice (eagerly,
  then while capturing) and with several processes every rank waits for it: on 4 H100s the first 15 of 45 steps
  ran at half speed. The log line counts the shapes that got a graph; where a capture failed it says why, and the
  shapes without a graph run eagerly (slower, the same results).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn.functional as F

from llm_surgery.box_data import IGNORE_INDEX
from llm_surgery.cuda_graphs import GraphedByShape

from .evaluate import completion_loss_inputs

LENGTH_MULTIPLE = 32
SPAN_MULTIPLE = 16
MAX_PREPARED = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _scored_positions(length: int, span: int) -> int:
    """The positions the LM head runs on in a graph: the completion span rounded up to SPAN_MULTIPLE, at most the
    padded length."""
    return min(length, _round_up(span, SPAN_MULTIPLE))


def run_shapes(sampler, data, micro_batches_done: int, count: int) -> Counter:
    """How often each graph shape (batch, padded length, scored span) occurs in this rank's next `count`
    micro-batches, as the collator (`pad_to_multiple_of=LENGTH_MULTIPLE`, left padding) and `GraphedLoss` make them."""
    sizes = []  # (tokens, completion span) of every example: the span runs from its first label to its end
    for f in data.features:
        labels = f["labels"]
        first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
        sizes.append((len(labels), len(labels) - first))
    shapes = Counter()
    for shard in sampler.ahead(micro_batches_done, count):
        length = _round_up(max(sizes[i][0] for i in shard), LENGTH_MULTIPLE)
        shapes[len(shard), length, _scored_positions(length, max(sizes[i][1] for i in shard))] += 1
    return shapes


def refusal(cfg, accelerator, model) -> str | None:
    """Why this run's steps cannot be replayed from graphs, or None when they can."""
    if not cfg.cuda_graphs:
        return "--no-cuda-graphs"
    if accelerator.device.type != "cuda":
        return "not on CUDA"
    if cfg.fsdp:
        return "FSDP2 gathers and frees parameters around every layer, outside any graph"
    if cfg.gradient_checkpointing:
        return "--gradient-checkpointing"
    if accelerator.mixed_precision == "fp16":
        return "fp16's loss scaling skips steps on the host"
    config = model.config
    if (getattr(config, "num_local_experts", 0) or 0) > 0 or (getattr(config, "n_routed_experts", 0) or 0) > 0:
        return "the host routes tokens to experts with host-side counts"
    return None


def prepare_summary(shapes: Counter, captured: list, failed: str | None, seconds: float) -> str:
    """The log line of `GraphedLoss.prepare`: how many batch shapes have graphs, their share of the micro-batches,
    and, where a capture failed, why and that the other shapes run eagerly (slower, same results)."""
    share = sum(shapes[s] for s in captured) / max(1, sum(shapes.values()))
    line = (f"{len(captured)} of {len(shapes)} batch shapes captured ({100 * share:.0f}% of this process's "
            f"micro-batches) in {seconds:.1f} s")
    if failed:
        line += f"; a capture failed, so the other shapes run eagerly: {failed}"
    return line


def _flat_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Point every parameter's .grad at a slice of one zeroed buffer per dtype; returns the buffers."""
    buffers = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
        start = 0
        for p in group:
            p.grad = flat[start:start + p.numel()].view_as(p)
            start += p.numel()
        buffers.append(flat)
    return buffers


class GraphedLoss:
    """`self(batch, span) -> loss` of one micro-batch, its backward done (gradients added into the flat buffers)."""

    def __init__(self, model, params: list[torch.Tensor], grad_accum: int, mixed_precision: str):
        self.model, self.grad_accum = model, grad_accum
        self.bf16 = mixed_precision == "bf16"
        self.flat = _flat_grads(params)
        self.graphs = GraphedByShape(self._forward_backward, name="llm-surgery train")

    def _forward_backward(self, input_ids, attention_mask, labels):
        # the model has no autocast wrapper (it is not prepared); without the weight cache: a cast made outside a
        # capture must not be read inside it
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False):
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            logits, labels = completion_loss_inputs(self.model, batch, labels.shape[1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        (loss / self.grad_accum).backward()
        return loss.detach()

    def __call__(self, batch: dict, span: int) -> torch.Tensor:
        ids = batch["input_ids"]
        k = _scored_positions(ids.shape[1], span)
        return self.graphs(ids, batch["attention_mask"], batch["labels"][:, -k:]).clone()

    def prepare(self, shapes: Counter, device) -> str:
        """Capture the graphs of the most frequent `shapes` now, on placeholder tokens (their gradients are then
        cleared); returns what was done, for the log. The random streams are left as they were: the placeholder
        calls draw dropout masks, and a resumed run, which prepares the shapes still ahead (fewer), would otherwise
        continue from other draws than the uninterrupted run."""
        t0, captured = time.perf_counter(), []
        with torch.random.fork_rng(devices=[device]):
            for batch, length, span in (s for s, _ in shapes.most_common(MAX_PREPARED)):
                ids = torch.zeros(batch, length, dtype=torch.long, device=device)
                mask = torch.ones(batch, length, dtype=torch.bool, device=device)
                labels = torch.zeros(batch, span, dtype=torch.long, device=device)
                graphs_before = len(self.graphs.graphs)
                for _ in range(2):  # eagerly, then captured
                    self.graphs(ids, mask, labels)
                if len(self.graphs.graphs) > graphs_before:
                    captured.append((batch, length, span))
        self.zero_grad()
        torch.cuda.synchronize(device)
        return prepare_summary(shapes, captured, self.graphs.failed, time.perf_counter() - t0)

    def zero_grad(self) -> None:
        for flat in self.flat:
            flat.zero_()

    def all_reduce(self, world_size: int) -> None:
        """Average the gradients over the processes (NCCL takes a complex buffer as its real view)."""
        import torch.distributed as dist

        for flat in self.flat:
            dist.all_reduce(torch.view_as_real(flat) if flat.is_complex() else flat)
            flat.div_(world_size)


def broadcast_trainable(params: list[torch.Tensor]) -> None:
    """Every process takes rank 0's trainable tensors, as DDP's construction does."""
    import torch.distributed as dist

    for p in params:
        dist.broadcast(torch.view_as_real(p.data) if p.is_complex() else p.data, 0)
