"""Medusa heads (Cai et al., arXiv 2401.10774) as a drafter.

Head i maps the target's final-normed hidden h_t of the last committed token t to logits for token t+2+i:
x = h_t; x = x + SiLU(W_l x + b_l) for each of num_layers residual blocks (W zero-initialised: identity at the
start of training); logits = head_i(x). The root token t+1 is already emitted (sampled from the target's own
lm_head(h_t)), so head 0 proposes the depth-1 candidates, head 1 depth 2, and so on.

Files beside the model (or anywhere, given with --spec-medusa PATH):
  medusa_config.json        {"num_heads", "num_layers", "hidden", "vocab", "shared_head"}
  medusa_heads.safetensors  medusa.{i}.res.{l}.weight [H, H], medusa.{i}.res.{l}.bias [H],
                            medusa.{i}.head.weight [V, H] (absent when shared_head: the target's lm_head is used)

Candidates form a tree given as Medusa-style paths of per-head top-k ranks: [1, 0] is the 2nd-best token of
head 0 followed by the best token of head 1. Every prefix of a path is a node too (added when missing). The
drafts are deterministic candidates (q = None), so verification stays lossless at any temperature.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from turbospec.config import parse_tree
from turbospec.errors import TurboSpecError
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree
from turbospec.weights import dequantize, is_packed

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"
class MedusaTree:
    """A fixed tree shape: nodes sorted by (depth, ranks); parents precede children."""

    def __init__(self, paths: list[tuple[int, ...]]):
        self.paths = sorted(set(map(tuple, paths)), key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(self.paths)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.depth = max(len(p) for p in self.paths)
        self.topk = [1 + max(p[-1] for p in self.paths if len(p) == d + 1) for d in range(self.depth)]
        self._limited: dict[int, MedusaTree] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def limit(self, max_depth: int) -> MedusaTree:
        """The subtree of nodes at depth <= max_depth."""
        if max_depth >= self.depth:
            return self
        if max_depth not in self._limited:
            self._limited[max_depth] = MedusaTree([p for p in self.paths if len(p) <= max_depth])
        return self._limited[max_depth]

    def build(self, candidates: list[list[int]], source: str = "medusa") -> DraftTree:
        """candidates[d] = the top-k tokens of head d, best first."""
        tokens = [candidates[len(p) - 1][p[-1]] for p in self.paths]
        return DraftTree(tokens, list(self.parents), [None] * len(tokens), source)


# ---- the heads (a torch module: used for training, and as the weight container) --------------------------
class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # identity at init (Medusa)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """num_heads x (num_layers ResBlocks + a [V, H] head). With shared_head the heads reuse a frozen lm_head
    weight passed as `lm_head` (not saved). Without it each head starts as a copy of `lm_head` when given."""

    def __init__(self, hidden: int, vocab: int, num_heads: int = 3, num_layers: int = 1, shared_head: bool = False,
                 lm_head: torch.Tensor | None = None):
        super().__init__()
        self.hidden, self.vocab, self.num_heads, self.num_layers = hidden, vocab, num_heads, num_layers
        self.shared_head = shared_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))
        if shared_head:
            if lm_head is None:
                raise ValueError("shared_head needs the target's lm_head weight")
            self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
            self.heads = None
        else:
            self.heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
            if lm_head is not None:
                with torch.no_grad():
                    for h in self.heads:
                        h.weight.copy_(lm_head.float())

    @property
    def config(self) -> dict:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers, "hidden": self.hidden,
                "vocab": self.vocab, "shared_head": self.shared_head}

    def head_logits(self, i: int, h: torch.Tensor) -> torch.Tensor:
        x = self.blocks[i](h)
        w = self.lm_head if self.shared_head else self.heads[i].weight
        return x @ w.t()

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        """h [..., H] -> [logits of head i [..., V] for each i]."""
        return [self.head_logits(i, h) for i in range(self.num_heads)]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(self.num_heads):
            for la, blk in enumerate(self.blocks[i]):
                out[f"medusa.{i}.res.{la}.weight"] = blk.linear.weight.detach().contiguous()
                out[f"medusa.{i}.res.{la}.bias"] = blk.linear.bias.detach().contiguous()
            if not self.shared_head:
                out[f"medusa.{i}.head.weight"] = self.heads[i].weight.detach().contiguous()
        return out

    def load_tensors(self, t: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.tensors().items():
                if name not in t:
                    raise TurboSpecError(f"{WEIGHTS_NAME}: missing tensor {name!r}")
                if tuple(t[name].shape) != tuple(p.shape):
                    raise TurboSpecError(f"{WEIGHTS_NAME}: {name} has shape {tuple(t[name].shape)}, "
                                         f"expected {tuple(p.shape)}")
                p.copy_(t[name])


def save_heads(out_dir: str | Path, heads: MedusaHeads, extra: dict | None = None) -> Path:
    """Write medusa_config.json + medusa_heads.safetensors (atomically: temp file then rename)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file({k: v.float().cpu() for k, v in heads.tensors().items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps({**heads.config, **(extra or {})}, indent=2))
    return out


def find_heads(path: str | Path) -> Path | None:
    """The directory holding medusa_config.json: `path` itself, or the directory of a .safetensors path."""
    p = Path(path)
    if p.is_file():
        p = p.parent
    return p if (p / CONFIG_NAME).exists() and (p / WEIGHTS_NAME).exists() else None


def load_heads(path: str | Path, hidden: int | None = None, vocab: int | None = None,
               lm_head: torch.Tensor | None = None) -> MedusaHeads:
    """Load heads from a directory (or its medusa_heads.safetensors); checks them against the target's shape."""
    from safetensors.torch import load_file

    d = find_heads(path)
    if d is None:
        raise TurboSpecError(f"no Medusa heads at {path} (need {CONFIG_NAME} and {WEIGHTS_NAME}; "
                             "train them with `python -m training.heads`)")
    try:
        cfg = json.loads((d / CONFIG_NAME).read_text())
        nh, nl, hd, vb = (int(cfg[k]) for k in ("num_heads", "num_layers", "hidden", "vocab"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TurboSpecError(f"{d / CONFIG_NAME}: invalid Medusa config ({e})") from None
    if hidden is not None and hd != hidden:
        raise TurboSpecError(f"Medusa heads hidden size {hd} != target hidden size {hidden}")
    if vocab is not None and vb != vocab:
        raise TurboSpecError(f"Medusa heads vocab {vb} != target vocab {vocab}")
    shared = bool(cfg.get("shared_head", False))
    if shared and lm_head is None:
        raise TurboSpecError("these Medusa heads share the target's lm_head: load them with a target")
    heads = MedusaHeads(hd, vb, nh, nl, shared, lm_head if shared else None)
    try:
        tensors = load_file(str(d / WEIGHTS_NAME))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt files
        raise TurboSpecError(f"{d / WEIGHTS_NAME}: cannot read ({' '.join(str(e).split())[:150]})") from None
    heads.load_tensors(tensors)
    return heads


# ---- the drafter -----------------------------------------------------------------------------------------
class MedusaDrafter(Drafter):
    """Proposes a Medusa tree from the hidden row of the last committed token.

    n_max passed to propose() caps the tree's depth (the longest accepted run), not its node count.
    """

    name = "medusa"
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, target, tree: MedusaTree | None = None):
        from turbospec.layers.linear import Linear

        if tree is not None and tree.depth > heads.num_heads:
            raise TurboSpecError(f"--spec-tree is {tree.depth} deep but there are only {heads.num_heads} "
                                 "Medusa heads")
        self.tree = tree or MedusaTree(parse_tree(None)).limit(heads.num_heads)
        dt = target.dtype
        self.blocks = [[Linear(b.linear.weight.detach().to(dt), b.linear.bias.detach().to(dt)) for b in blk]
                       for blk in heads.blocks]
        self.heads = None if heads.shared_head else [Linear(h.weight.detach().to(dt)) for h in heads.heads]
        self.lm_head = target.lm_head
        self.h: torch.Tensor | None = None

    @torch.inference_mode()
    def candidates(self, h: torch.Tensor, topk: list[int]) -> list[list[int]]:
        """The top-k tokens of heads 0..len(topk)-1 from one hidden row h [1, H]."""
        xs = []
        for i in range(len(topk)):
            x = h
            for lin in self.blocks[i]:
                x = x + F.silu(lin(x))
            xs.append(x)
        if self.heads is None:
            logits = self.lm_head(torch.cat(xs, 0)).float()
            rows = [logits[i] for i in range(len(xs))]
        else:
            rows = [self.heads[i](x).float()[0] for i, x in enumerate(xs)]
        return [r.topk(k).indices.tolist() for r, k in zip(rows, topk)]

    def prompt_rows(self, n: int) -> int:
        return 1  # the heads read the last prompt row only

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        assert hidden is not None
        self.h = hidden[-1:]

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        if self.h is None or n_max < 1:
            return DraftTree()
        tree = self.tree.limit(n_max)
        return tree.build(self.candidates(self.h, tree.topk), self.name)

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        assert hidden is not None and hidden.shape[0] == len(committed)
        self.h = hidden[-1:]


def make_medusa_drafter(target, path: str | Path, tree_spec: str | list | None = None) -> MedusaDrafter:
    """Heads from `path`; the tree from tree_spec (default DEFAULT_TREE, cut to the number of heads).

    Hybrid targets verify trees too (every node's Gated DeltaNet state follows its own root path), up to the
    cache's rollback_limit nodes per step (16 by default)."""
    lm = target.lm_head.weight
    heads = load_heads(path, target.cfg.hidden_size, target.cfg.vocab_size, dequantize(lm) if is_packed(lm) else lm)
    tree = MedusaTree(parse_tree(tree_spec)) if tree_spec else MedusaTree(parse_tree(None)).limit(heads.num_heads)
    return MedusaDrafter(heads, target, tree)
