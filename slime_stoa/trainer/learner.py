"""A small PyTorch learner: stoa's trainer side without Megatron (quickstart, CPU tests).

It keeps float32 master weights but always *acts* with their bf16 rounding — exactly the weights
it publishes and the workers serve — by a straight-through forward: the forward pass sees
bf16(master), the gradient flows to the master. So the trainer-vs-worker logprob gap on the same
version measures only numerics, not precision.

Loss: GRPO advantages per prompt group (optionally std-scaled), the DPPO loss of
`slime_stoa.trainer.loss` on the worker logprobs, AdamW. A tool episode's observation tokens
(`TrainSequence.mask` 0) are context only: no loss, no gradient, not counted in the token mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call

from slime_stoa.protocol.hf.folders import bf16_bits_to_f32, f32_to_bf16_bits, load_hf_state

from .loss import DPPOConfig, dppo_policy_loss, reduce_per_token
from .param_map import checkpoint_slots


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """Optimisation settings of the CPU learner."""

    lr: float = 3e-4  # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    temperature: float = 1.0  # the run's sampling temperature (logprobs are tempered)
    scale_rewards: bool = True  # GRPO: divide advantages by the group's std (False: Dr.GRPO)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    micro_batch: int = 32  # sequences per forward pass
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.temperature > 0 and self.micro_batch >= 1):
            raise ValueError("lr and temperature must be positive and micro_batch >= 1")


@dataclass(frozen=True, slots=True)
class TrainSequence:
    """One sample of a prompt group, as the learner needs it."""

    prompt: np.ndarray  # int token ids
    response: np.ndarray  # int token ids
    worker_logprobs: np.ndarray  # float32, one per response token (ignored where mask is 0)
    reward: float  # the trainer's recomputed reward
    mask: np.ndarray | None = None  # 1 = model token (trained on), 0 = tool token; None: all ones

    def loss_mask(self) -> np.ndarray:
        """float32, one per response token: 1 where the model sampled it."""
        if self.mask is None:
            return np.ones(len(self.response), np.float32)
        if len(self.mask) != len(self.response):
            raise ValueError(f"mask has {len(self.mask)} values for {len(self.response)} response tokens")
        return np.asarray(self.mask, dtype=np.float32)


def group_advantages(rewards: Sequence[float], *, scale: bool, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages of one group: reward minus the group mean, optionally over the std."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if scale:
        adv = adv / (r.std() + eps)
    return adv.astype(np.float32)


class Learner:
    def __init__(self, model_dir: str | Path, config: LearnerConfig = LearnerConfig()):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.manual_seed(config.seed)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        # The published tensor set is the checkpoint's, under its names and shapes (tied heads
        # not duplicated, fused experts split, buffers included: `param_map`).
        checkpoint = load_hf_state(model_dir)
        self.names = list(checkpoint)
        self.slots = checkpoint_slots(self.model, self.names, {n: a.shape for n, a in checkpoint.items()})
        del checkpoint
        with torch.no_grad():  # a published buffer (never trained) acts with the bf16 the workers get
            buffers = dict(self.model.named_buffers())
            for slot in self.slots.values():
                if slot.kind == "buffer":
                    buffers[slot.tensor].copy_(buffers[slot.tensor].to(torch.bfloat16).to(torch.float32))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )

    # -- weights -----------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        return {**dict(self.model.named_buffers()), **dict(self.model.named_parameters())}

    def bf16_state(self) -> dict[str, np.ndarray]:
        """The policy's weights as bf16 bits under the checkpoint's names (what gets published)."""
        tensors = self._tensors()
        return {
            n: f32_to_bf16_bits(np.ascontiguousarray(self.slots[n].view(tensors).detach().cpu().numpy()))
            for n in self.names
        }

    @torch.no_grad()
    def load_bf16_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Put published bf16 weights (checkpoint names) into the float32 master (a resume)."""
        tensors = self._tensors()
        for name, bits in state.items():
            self.slots[name].view(tensors).copy_(torch.from_numpy(bf16_bits_to_f32(bits)))

    def _acting_params(self) -> dict[str, torch.Tensor]:
        """bf16-rounded parameters whose gradient flows to the float32 master (straight-through)."""
        out = {}
        for name, p in self.model.named_parameters():
            rounded = p.detach().to(torch.bfloat16).to(torch.float32)
            out[name] = p + (rounded - p.detach())
        return out

    # -- forward -----------------------------------------------------------------------------
    def _response_logprobs(self, seqs: Sequence[TrainSequence], params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Tempered logprobs of each response token under `params` (one tensor per sequence)."""
        lengths = [len(s.prompt) + len(s.response) for s in seqs]
        width = max(lengths)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens = np.concatenate([s.prompt, s.response]).astype(np.int64)
            ids[i, : len(tokens)] = torch.from_numpy(tokens)
            mask[i, : len(tokens)] = 1
        # Only the rows that predict response tokens are needed: the head runs on the last `keep`
        # positions (from the shortest prompt's last token on), and the softmax on each
        # sequence's response rows alone. On a real vocabulary (49k-128k) the prompt rows' logits
        # and their softmax were most of the step's memory.
        first = min(len(s.prompt) for s in seqs) - 1
        keep = width - first
        logits = functional_call(self.model, params, (ids,), {"attention_mask": mask, "logits_to_keep": keep}).logits
        out = []
        for i, s in enumerate(seqs):
            p, r = len(s.prompt), len(s.response)
            # logits at position t predict token t + 1; row t sits at t - first of the kept ones
            rows = logits[i, p - 1 - first : p + r - 1 - first].float() / self.config.temperature
            out.append(rows.log_softmax(dim=-1).gather(1, ids[i, p : p + r].unsqueeze(1)).squeeze(1))
        return out

    @torch.no_grad()
    def logprobs(self, seqs: Sequence[TrainSequence]) -> list[np.ndarray]:
        """The current policy's tempered logprobs of each response (for the logprob-gap check)."""
        params = {k: v.detach() for k, v in self._acting_params().items()}
        out: list[np.ndarray] = []
        for start in range(0, len(seqs), self.config.micro_batch):
            out += [t.cpu().numpy() for t in self._response_logprobs(seqs[start : start + self.config.micro_batch], params)]
        return out

    # -- training ----------------------------------------------------------------------------
    def step(self, groups: Sequence[Sequence[TrainSequence]]) -> dict[str, float]:
        """One optimizer step on a batch of prompt groups; returns scalar metrics."""
        cfg = self.config
        seqs = [s for g in groups for s in g]
        advantages = np.concatenate([group_advantages([s.reward for s in g], scale=cfg.scale_rewards) for g in groups])
        masks = [s.loss_mask() for s in seqs]
        total_tokens = int(sum(m.sum() for m in masks))  # model tokens: the token mean's denominator
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_total = 0.0
        for start in range(0, len(seqs), cfg.micro_batch):
            chunk = seqs[start : start + cfg.micro_batch]
            logps = self._response_logprobs(chunk, self._acting_params())
            lengths = [len(s.response) for s in chunk]
            logp = torch.cat(logps)
            here = logp.device  # the model's (the CPU; a GPU where a check moved it there)
            worker = torch.from_numpy(np.concatenate([s.worker_logprobs for s in chunk]).astype(np.float32)).to(here)
            adv = torch.from_numpy(
                np.repeat(advantages[start : start + len(chunk)], lengths).astype(np.float32)
            ).to(here)
            mask = torch.from_numpy(np.concatenate(masks[start : start + len(chunk)])).to(here)
            per_token, metrics = dppo_policy_loss(logp, worker, adv, mask, cfg.dppo)
            # token_mean over the whole batch: scale each chunk's sum by the batch's token count
            if cfg.dppo.reduction == "token_mean":
                loss = per_token.sum() / max(total_tokens, 1)
            else:
                loss = reduce_per_token(
                    per_token, mask, lengths, reduction=cfg.dppo.reduction, drgrpo_max_len=cfg.dppo.drgrpo_max_len
                ) * (len(chunk) / len(seqs))
            loss.backward()
            loss_total += float(loss.detach())
            weight = float(mask.sum()) / max(total_tokens, 1)
            for k, v in metrics.items():
                if k != "tokens":
                    sums[k] = sums.get(k, 0.0) + float(v.detach()) * weight
        grad_norm = (
            float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)) if cfg.grad_clip else 0.0
        )
        self.optimizer.step()
        rewards = [s.reward for s in seqs]
        return {
            "loss": loss_total,
            "grad_norm": grad_norm,
            "reward_mean": float(np.mean(rewards)),
            "tokens": float(total_tokens),
            **sums,
        }

    def supervised_step(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        """One cross-entropy step on (prompt, target) token pairs — the optional format warm start."""
        seqs = [TrainSequence(p, t, np.zeros(len(t), np.float32), 0.0) for p, t in pairs]
        self.optimizer.zero_grad(set_to_none=True)
        logps = self._response_logprobs(seqs, self._acting_params())
        loss = -torch.cat(logps).mean()
        loss.backward()
        if self.config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        return float(loss.detach())
