"""Model definitions for training the bundled model.

The trunk is a transformers model (``Qwen3_5ForCausalLM`` -- hybrid Gated DeltaNet / gated attention --
or the dense ``Qwen3ForCausalLM``).  transformers ships no MTP module, so :class:`MTPModule` implements the
Qwen3.5 native multi-token-prediction head with the Qwen3.5 weight names::

    mtp.pre_fc_norm_embedding.weight   [H]      RMSNorm (same convention as the trunk)
    mtp.pre_fc_norm_hidden.weight      [H]      RMSNorm
    mtp.fc.weight                      [H, 2H]  input = concat(norm_e(embed(x_{t+1})), norm_h(h_t)), embedding first
    mtp.layers.0.*                     one full-attention decoder layer, same names as the trunk's attention layers
    mtp.norm.weight                    [H]      final RMSNorm, logits via the shared lm_head (tied embeddings)

h_t is the trunk's hidden state after its final norm.  The MTP element j (combining h_j and x_{j+1}) uses
rotary position j, as vLLM does; its attention is causal over the MTP elements.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

ARCHS = ("qwen3_5_text", "qwen3")


def build_config(arch: str, vocab_size: int, hidden: int = 384, layers: int = 8, heads: int = 6,
                 kv_heads: int = 2, head_dim: int = 64, intermediate: int = 1024, max_pos: int = 8192,
                 eos_token_id: int = 0, rope_theta: float = 100000.0, full_attention_interval: int = 4,
                 partial_rotary: float = 0.25, linear_heads: int = 4, linear_head_dim: int = 64):
    common = {
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "bos_token_id": None, "initializer_range": 0.02,
    }
    if arch == "qwen3_5_text":
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                             "partial_rotary_factor": partial_rotary},
            full_attention_interval=full_attention_interval,
            linear_num_key_heads=linear_heads, linear_num_value_heads=linear_heads,
            linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
            linear_conv_kernel_dim=4,
        )
    elif arch == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    return cfg


def _classes(arch: str):
    if arch == "qwen3_5_text":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        return m.Qwen3_5ForCausalLM, m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm
    from transformers.models.qwen3 import modeling_qwen3 as m

    return m.Qwen3ForCausalLM, m.Qwen3DecoderLayer, m.Qwen3RMSNorm


class MTPModule(nn.Module):
    def __init__(self, config, arch: str, num_layers: int = 1):
        super().__init__()
        _, layer_cls, norm_cls = _classes(arch)
        h = config.hidden_size
        lcfg = copy.deepcopy(config)
        lcfg.num_hidden_layers = num_layers
        lcfg.layer_types = ["full_attention"] * num_layers
        self.pre_fc_norm_embedding = norm_cls(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer_cls(lcfg, i) for i in range(num_layers)])
        self.norm = norm_cls(h, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings, step: int = 0):
        """hidden: trunk final-normed h_t [B,T,H]; next_embeds: embed(x_{t+1}) [B,T,H] -> normed MTP hidden."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        layer = self.layers[step % len(self.layers)]
        u = layer(u, position_embeddings=position_embeddings, attention_mask=None)
        if isinstance(u, tuple):
            u = u[0]
        return self.norm(u)


class TrunkWithMTP(nn.Module):
    """A transformers causal LM plus the MTP module, with a joint loss."""

    def __init__(self, config, arch: str, mtp_layers: int = 1):
        super().__init__()
        lm_cls, _, _ = _classes(arch)
        self.arch = arch
        self.config = config
        self.lm = lm_cls(config)
        self.mtp = MTPModule(config, arch, mtp_layers)
        self._init_mtp()

    def _init_mtp(self):
        std = self.config.initializer_range
        for mod in self.mtp.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, mean=0.0, std=std)
        # copy the norm init convention from the trunk (ones for qwen3, zeros for zero-centred qwen3_5)
        fill = 0.0 if self.arch == "qwen3_5_text" else 1.0
        for mod in self.mtp.modules():
            if type(mod) is type(self.lm.model.norm):
                with torch.no_grad():
                    mod.weight.fill_(fill)
        # zero-centred qwen3_5 GDN/attention layers already initialised by post_init in the trunk

    def forward(self, input_ids: torch.Tensor, mtp_weight: float = 0.3, weights: torch.Tensor | None = None):
        """Returns (total_loss, lm_loss, mtp_loss).  ``weights`` [B,T]: loss weight of each token as a target."""
        base = self.lm.model
        out = base(input_ids=input_ids, use_cache=False)
        h = out.last_hidden_state  # final-normed
        logits = self.lm.lm_head(h[:, :-1])
        lm_loss = _wce(logits, input_ids[:, 1:], None if weights is None else weights[:, 1:])
        self.answer_acc = _weighted_acc(logits, input_ids[:, 1:], weights)
        if mtp_weight <= 0:
            return lm_loss, lm_loss, torch.zeros((), device=lm_loss.device)
        T = input_ids.shape[1]
        pos = torch.arange(T - 2, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
        emb = base.embed_tokens(input_ids[:, 1:T - 1])
        pe = base.rotary_emb(h, pos)
        u = self.mtp(h[:, :T - 2], emb, pe)
        mlogits = self.lm.lm_head(u)
        mtp_loss = _wce(mlogits, input_ids[:, 2:], None if weights is None else weights[:, 2:])
        return lm_loss + mtp_weight * mtp_loss, lm_loss, mtp_loss

    @torch.no_grad()
    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """MTP logits for elements j (h_j, x_{j+1}), positions 0..T-1."""
        base = self.lm.model
        T = next_ids.shape[1]
        pos = torch.arange(T, device=next_ids.device).unsqueeze(0).expand(next_ids.shape[0], -1)
        pe = base.rotary_emb(hidden, pos)
        return self.lm.lm_head(self.mtp(hidden, base.embed_tokens(next_ids), pe))

    def export_state_dict(self) -> dict:
        sd = {}
        for k, v in self.lm.state_dict().items():
            if k == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            sd[k] = v
        for k, v in self.mtp.state_dict().items():
            sd["mtp." + k] = v
        return sd


@torch.no_grad()
def _weighted_acc(logits, targets, weights) -> tuple[int, int]:
    """(correct, total) argmax hits on the up-weighted targets (the retrieval answers' values)."""
    if weights is None:
        return 0, 0
    mask = weights[:, 1:] > 1
    n = int(mask.sum())
    if n == 0:
        return 0, 0
    return int((logits.argmax(-1) == targets)[mask].sum()), n


def _wce(logits, targets, w):
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    if w is None:
        return ce.mean()
    w = w.reshape(-1).to(ce.dtype)
    return (ce * w).sum() / w.sum()


def count_params(model: nn.Module) -> int:
    seen = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n
