"""Multi-token-prediction head for the Qwen3 target, in the Qwen3-Next ``mtp.*`` layout.

At position t it reads the target's final-normed hidden state h_t (what the LM head
consumes) and the embedding of token t+1, and predicts token t+2:

    x = fc(concat(pre_fc_norm_embedding(embed(tok[t+1])), pre_fc_norm_hidden(h_t)))
    x = layers.0(x)            # one Qwen3 decoder layer, causal over positions
    logits = lm_head(norm(x))  # the target's tied embedding

All norms are Qwen3 RMSNorms (``x * w``, not Qwen3-Next's ``x * (1 + w)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .models import CausalLM, DecoderLayer, ModelSpec, RMSNorm

MTP_DESCRIPTION = {
    "file": "mtp.safetensors",
    "prefix": "mtp.",
    "num_nextn_predict_layers": 1,
    "predicts": "token t+2 from the target's final-normed hidden state at t and embed(token t+1)",
    "fc_input": "concat(pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)) -> fc [H, 2H]",
    "layer": "mtp.layers.0.* is one Qwen3 decoder layer (same names/config as model.layers.N)",
    "norms": "Qwen3 RMSNorm x*w (weights initialised to 1), eps = rms_norm_eps",
    "output": "mtp.norm, then the target's tied embed_tokens as lm_head",
    "rope": "same rope_theta as the target; positions are relative, so t or t+1 is equivalent",
    "hidden_for_next_step": "output of mtp.norm (trained only one step deep)",
}


class MTPHead(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        H = spec.hidden_size
        self.spec = spec
        self.pre_fc_norm_embedding = RMSNorm(H, spec.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, spec.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(spec)])
        self.norm = RMSNorm(H, spec.rms_norm_eps)

    @classmethod
    def from_target(cls, target: CausalLM) -> MTPHead:
        """Start the decoder layer from a copy of the target's last layer and fc from a
        small random matrix plus identity on the hidden half."""
        head = cls(target.spec)
        head.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        H = target.spec.hidden_size
        with torch.no_grad():
            nn.init.normal_(head.fc.weight, std=0.02)
            head.fc.weight[:, H:] += torch.eye(H)
        return head

    def forward(self, target: CausalLM, hidden: torch.Tensor, next_ids: torch.Tensor):
        """hidden [B, T, H] final-normed target states at t; next_ids [B, T] tokens t+1.
        Returns the normed MTP hidden states (logits via ``target.head``)."""
        x = self.merge(target, hidden, next_ids)
        cos, sin = target.rope("full_attention", x.shape[1], x.device)
        x = self.layers[0](x, cos, sin, None)
        return self.norm(x)

    def merge(self, target: CausalLM, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """``fc`` over the normed embedding of token t+1 and the normed state at t."""
        e = self.pre_fc_norm_embedding(target.embed(next_ids))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def export_state(self) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v for k, v in self.state_dict().items()}


def mtp_logits(head: MTPHead, target: CausalLM, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window [B, L+1] -> (logits [B, L-1, V] for tokens t+2, the targets [B, L-1])."""
    ids = window[:, :-1]
    with torch.no_grad():
        hidden = target.hidden(ids)
    out = head(target, hidden[:, :-1], ids[:, 1:])
    return target.head(out), window[:, 2:]


def chain_outputs(head: MTPHead, target: CausalLM, hidden: torch.Tensor, ids: torch.Tensor,
                  depth: int) -> list[torch.Tensor]:
    """The head chained ``depth`` steps deep from every anchor at once, as the engine drafts.

    ``hidden`` [B, T, H]: the target's final-normed states at anchors t = 0..T-1; ``ids``
    [B, T + depth]: step j (1-based) at anchor t reads token ``ids[:, t + j]`` and, for j > 1,
    step j - 1's output at t instead of a target state; it predicts token t + j + 1.

    In the engine the head's cache holds one entry per position the target verified (step 1's
    inputs), and a chained step appends its own entry after the anchor's: so step j at anchor
    t attends to step 1's entries at anchors <= t and to steps 2..j's at anchor t alone, at
    positions t + j - 1. Here that is one masked attention per step over the keys of every
    step so far. Returns the normed outputs of steps 1..depth, each [B, T, H].
    """
    T = hidden.shape[1]
    cos, sin = target.rope("full_attention", T + depth, hidden.device)
    anchors = torch.arange(T, device=hidden.device)
    causal = anchors[None, :] <= anchors[:, None]
    same = anchors[None, :] == anchors[:, None]
    earlier: list = []  # each step's keys and values, read by every later step
    outputs, h = [], hidden
    for j in range(1, depth + 1):
        x = head.merge(target, h, ids[:, j : j + T])
        mask = torch.cat([causal] + [same] * (j - 1), dim=1)
        x = head.layers[0](x, cos[j - 1 : j - 1 + T], sin[j - 1 : j - 1 + T], mask, earlier)
        h = head.norm(x)
        outputs.append(h)
    return outputs


def chain_loss(head: MTPHead, target: CausalLM, window: torch.Tensor, depth: int,
               decay: float) -> torch.Tensor:
    """Distillation through the chain: step j's distribution against the frozen target's at
    the position it predicts (KL(target || head), what acceptance measures), weighted
    ``decay ** (j - 1)``: a later draft only counts once every earlier one was accepted."""
    ids = window[:, :-1]
    T = ids.shape[1] - depth
    with torch.no_grad():
        states = target.hidden(ids)
        teacher = target.head(states)
    outputs = chain_outputs(head, target, states[:, :T], ids, depth)
    total, weights = 0.0, 0.0
    for j, out in enumerate(outputs, start=1):
        w = decay ** (j - 1)
        V = teacher.shape[-1]
        log_q = F.log_softmax(target.head(out).float().reshape(-1, V), dim=-1)
        log_p = F.log_softmax(teacher[:, j : j + T].float().reshape(-1, V), dim=-1)
        total = total + w * F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        weights += w
    return total / weights
