"""The trainer's forward and backward, replayed from CUDA graphs (`--cuda-graphs`, on by default on one GPU).

At the recipes' batch (8 Box examples of ~100 tokens) a frozen 3B host's step is bound by the CPU's kernel
launches, not by the GPU: the granite3b recipe on a random-weight granite-4.0-h-micro with 4 pdssm layers took
305 ms a step eagerly (298 of them issuing kernels) and 82 ms replayed, 2,202 against 9,461 tokens/s (one H100;
BENCHMARKS.md). Here each micro-batch's forward and backward is one graph per batch shape
(`llm_surgery.cuda_graphs`), and so that a few graphs serve a run:
- batches are padded (left, masked) to a multiple of LENGTH_MULTIPLE tokens, and the scored span (the positions
  the LM head runs on) is rounded up to a multiple of SPAN_MULTIPLE; the extra positions hold padding or prompt
  tokens whose labels are ignored, so the loss is the same. On the recipes' Box data (1,000 sequences, word
  tokenizer) that is 3 shapes, two of them 97% of the batches, for 9% more tokens than padding to 8;
- one process only. With 2 processes (the model inside DDP, 2 H100s) the capture failed, cause not found yet;
  those runs keep eager steps under DDP, whose all-reduce overlaps the backward;
- gradients accumulate into one flat buffer per dtype that the trainable tensors' `.grad` view: the graph's
  backward adds into them and `zero_grad` clears them before a step (the graph keeps their addresses, so they are
  never set to None);
- the straight-through temperature is read from device memory (`FlashPDSSM.tau_held`), so annealing works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_surgery.cuda_graphs import GraphedByShape

LENGTH_MULTIPLE = 32
SPAN_MULTIPLE = 16


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
    if accelerator.num_processes > 1:
        return "several processes (the capture failed under DDP; they keep DDP's overlapped all-reduce)"
    if accelerator.mixed_precision == "fp16":
        return "fp16's loss scaling skips steps on the host"
    config = model.config
    if (getattr(config, "num_local_experts", 0) or 0) > 0 or (getattr(config, "n_routed_experts", 0) or 0) > 0:
        return "the host routes tokens to experts with host-side counts"
    return None


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
        # autocast without its weight cache: a cast made outside a capture must not be read inside it
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False):
            k = labels.shape[1]
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                logits_to_keep=k + 1).logits[:, :-1]
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        (loss / self.grad_accum).backward()
        return loss.detach()

    def __call__(self, batch: dict, span: int) -> torch.Tensor:
        ids = batch["input_ids"]
        k = min(ids.shape[1], -(-span // SPAN_MULTIPLE) * SPAN_MULTIPLE)
        return self.graphs(ids, batch["attention_mask"], batch["labels"][:, -k:]).clone()

    def zero_grad(self) -> None:
        for flat in self.flat:
            flat.zero_()
