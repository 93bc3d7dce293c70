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
        e = self.pre_fc_norm_embedding(target.embed(next_ids))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        cos, sin = target.rope("full_attention", x.shape[1], x.device)
        x = self.layers[0](x, cos, sin, None)
        return self.norm(x)

    def export_state(self) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v for k, v in self.state_dict().items()}


def mtp_logits(head: MTPHead, target: CausalLM, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window [B, L+1] -> (logits [B, L-1, V] for tokens t+2, the targets [B, L-1])."""
    ids = window[:, :-1]
    with torch.no_grad():
        hidden = target.hidden(ids)
    out = head(target, hidden[:, :-1], ids[:, 1:])
    return target.head(out), window[:, 2:]
