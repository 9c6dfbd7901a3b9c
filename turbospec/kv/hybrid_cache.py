"""Cache of a hybrid model: attention KV for the full-attention layers, conv + recurrent state for the
Gated DeltaNet layers, with the same begin / commit / reset / length contract as `KVCache`.

Rollback for speculative verification: a step of N <= `rollback_limit` tokens keeps the recurrent state
after *every* scratch position (and the conv window, from which the conv state after any prefix is a slice),
so `commit(keep=list(range(j)))` for any j <= N leaves every state exactly as if only those j tokens had been
processed, without re-running them. Tree steps (`set_tree(parents)`, verification of a token tree) work the
same way: every node's state is computed from its parent's, and `commit(keep=path)` keeps the state of the
path's last node and the conv rows along the path. Steps longer than `rollback_limit` (prefill chunks) keep
only the final state and can only be committed whole.

Prefix reuse across requests: `checkpoint()` keeps the committed states at the current length (up to
`max_checkpoints` of them, the newest), and `truncate(n)` goes back to n when n is a checkpoint's length (KV cut
back, states restored), so that a prompt that repeats an earlier one up to there resumes without re-processing it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from turbospec.errors import TurboSpecError
from turbospec.kv.cache import KVCache
from turbospec.kv.quant_cache import QuantKVCache

TREE_MESSAGE = "a tree step on a hybrid model must have at most rollback_limit nodes"


def kept_state(window: torch.Tensor, states: torch.Tensor, keep: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv state [K-1, C] and the recurrent state after the kept rows `keep` (a non-empty root path) of an n-row
    step of one GDN layer, from its conv window [K-1+n, C] and states ([n, ...] per row, or [1, ...] the final one):
    views into them where the kept rows are a chain prefix."""
    k = window.shape[0] - n
    j = len(keep)
    if keep == list(range(j)):  # a chain prefix: the conv rows are contiguous
        conv = window[j:j + k]
    else:  # a tree path: the committed rows, then the path's rows
        conv = torch.cat([window[:k], window[torch.tensor(keep, dtype=torch.int64, device=window.device) + k]])[-k:]
    return conv, states[keep[-1]] if states.shape[0] == n else states[-1]


class HybridCache:
    prefix_reusable = False  # the recurrent state after an arbitrary prefix is not kept (only at checkpoints)

    def __init__(
        self,
        num_attn_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_gdn_layers: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        max_len: int,
        dtype: torch.dtype,
        *,
        rollback_limit: int = 16,
        kv: KVCache | QuantKVCache | None = None,
        max_checkpoints: int = 0,
    ):
        # `kv` lets a caller pass another attention-KV store (e.g. a quantized format) with KVCache's
        # interface; only the attention layers ever see it.
        self.kv = (
            kv
            if kv is not None
            else KVCache(num_attn_layers, num_kv_heads, head_dim, max_len, dtype)
        )
        self.max_len = max_len
        self.dtype = dtype
        self.rollback_limit = rollback_limit
        self.step_rows = rollback_limit  # a verification step keeps every recurrent state up to this many rows
        self._conv_shape, self._ssm_shape = tuple(conv_shape), tuple(ssm_shape)
        self.num_gdn_layers = num_gdn_layers
        # committed states per GDN layer; after a step, views into that step's outputs (no copies) -- or, after a
        # whole chain step (`_loose`), the step's conv window and states themselves, trimmed to the last K-1 rows
        # and the last state when read (`_exact`): the one-call kernel reads them as they are (`gdn_state_raw`)
        self._conv: list[torch.Tensor] = []
        self._ssm: list[torch.Tensor] = []
        self._loose = False
        self._zero_states()
        self.pending = 0
        self._windows: list[torch.Tensor | None] = [None] * num_gdn_layers
        self._states: list[torch.Tensor | None] = [None] * num_gdn_layers
        self._all_states = False
        self._parents: list[int] | None = None
        self.max_checkpoints = max_checkpoints
        self._checkpoints: OrderedDict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()

    def _zero_states(self) -> None:
        self._loose = False
        self._conv = [torch.zeros(self._conv_shape, dtype=self.dtype) for _ in range(self.num_gdn_layers)]
        self._ssm = [torch.zeros(self._ssm_shape, dtype=torch.float32) for _ in range(self.num_gdn_layers)]

    def _exact(self) -> None:
        """The committed states as [K-1, C] and [Hv, Dk, Dv] views where a whole step left them loose."""
        if self._loose:
            k = self._conv_shape[0]
            self._conv = [c[c.shape[0] - k:] for c in self._conv]
            self._ssm = [st[-1] if st.dim() > len(self._ssm_shape) else st for st in self._ssm]
            self._loose = False

    @property
    def conv(self) -> torch.Tensor:
        """Committed conv states of all GDN layers, [layers, K-1, C] (a copy)."""
        self._exact()
        return torch.stack(self._conv) if self._conv else torch.zeros((0,) + self._conv_shape, dtype=self.dtype)

    @property
    def ssm(self) -> torch.Tensor:
        """Committed recurrent states of all GDN layers, [layers, Hv, Dk, Dv] float32 (a copy)."""
        self._exact()
        return torch.stack(self._ssm) if self._ssm else torch.zeros((0,) + self._ssm_shape)

    # ---- the step protocol -----------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.kv.length

    def begin(self, n: int) -> None:
        self.kv.begin(n)
        self.pending = n
        self._all_states = n <= self.rollback_limit
        self._parents = None
        self._windows = [None] * len(self._windows)
        self._states = [None] * len(self._states)

    def set_tree(self, parents: list[int] | None) -> None:
        """The current step is a token tree (parents[i]: index of node i's parent in the step, -1: the
        committed context); None for a chain. Call after begin()."""
        if parents is not None and not self._all_states:
            raise TurboSpecError(f"{TREE_MESSAGE} ({self.rollback_limit}); got {len(parents)}")
        self._parents = list(parents) if parents is not None else None

    @property
    def tree_parents(self) -> list[int] | None:
        return self._parents

    @property
    def track_all_states(self) -> bool:
        """Whether the current step keeps the state after every position (rollback to any prefix possible)."""
        return self._all_states

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layers: `layer` is the index among attention layers."""
        return self.kv.write(layer, k, v)

    def gdn_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (conv state [K-1, C], recurrent state [Hv, Dk, Dv]) of GDN layer `layer` (index among GDN
        layers). Read-only during a step."""
        self._exact()
        return self._conv[layer], self._ssm[layer]

    def gdn_state_raw(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`gdn_state` as the one-call kernel takes it: a conv window whose last K-1 rows are the conv state, and the
        recurrent state or states whose last one it is (a whole step's outputs, not trimmed to views)."""
        return self._conv[layer], self._ssm[layer]

    def gdn_stash(self, layer: int, window: torch.Tensor, states: torch.Tensor) -> None:
        """Scratch for the current step: the conv window [K-1+N, C] and the recurrent states ([N, ...] when
        `track_all_states`, else [1, ...] = the final state)."""
        self._windows[layer] = window
        self._states[layer] = states

    def _check_stashed(self) -> None:
        if any(w is None for w in self._windows) or any(s is None for s in self._states):
            raise TurboSpecError("commit before every Gated DeltaNet layer ran its step")

    def commit(self, keep: list[int] | None = None) -> None:
        n = self.pending
        if keep is None and self._parents is None and n:  # a whole chain step (decode, prefill): its last states,
            self._check_stashed()  # kept loose
            self._conv, self._ssm, self._loose = self._windows, self._states, True
            self.kv.commit(None)
            self.pending = 0
            self._windows = [None] * len(self._windows)
            self._states = [None] * len(self._states)
            return
        parents = self._parents if self._parents is not None else list(range(-1, n - 1))
        if keep is None:
            if self._parents is not None:
                raise TurboSpecError("a tree step must be committed with the accepted path (commit(keep))")
            keep = list(range(n))
        else:
            keep = list(keep)
            if len(keep) > n:
                raise TurboSpecError(f"commit keeps {len(keep)} positions but the step wrote only {n}")
            for a, b in zip([-1] + keep, keep):
                if not 0 <= b < n or parents[b] != a:
                    raise TurboSpecError(f"commit keeps {keep[:8]}, which is not a root path of the step "
                                         f"(parents {parents[:8]})")
            if 0 < len(keep) < n and not self._all_states:
                raise TurboSpecError(
                    f"cannot roll back a {n}-token step to {len(keep)} tokens: steps longer than rollback_limit="
                    f"{self.rollback_limit} keep only their final recurrent state"
                )
        prefix = keep == list(range(len(keep)))
        if keep:
            self._check_stashed()
            # views, not copies: the step's windows and states are fresh tensors no one writes to again
            kept = [kept_state(w, s, keep, n) for w, s in zip(self._windows, self._states)]  # type: ignore[arg-type]
            self._conv = [c for c, _ in kept]
            self._ssm = [s for _, s in kept]
            self._loose = False
        self.kv.commit(None if prefix and len(keep) == n else keep)
        self.pending = 0
        self._parents = None
        self._windows = [None] * len(self._windows)
        self._states = [None] * len(self._states)

    def truncate(self, n: int) -> None:
        """Keep the whole context (n >= length), nothing (n == 0), or go back to a checkpoint's length."""
        if n >= self.length:
            return
        if n <= 0:
            self.reset()
            return
        if n not in self._checkpoints:
            raise TurboSpecError(f"a hybrid cache cannot be cut back to {n} positions (recurrent states are kept "
                                 f"only at checkpoints: {list(self._checkpoints)})")
        self.kv.truncate(n)
        conv, ssm = self._checkpoints[n]
        self._conv, self._ssm, self._loose = list(conv), list(ssm), False
        for p in [p for p in self._checkpoints if p > n]:  # they continued another context
            del self._checkpoints[p]

    def resume_point(self, n: int) -> int:
        if n >= self.length:
            return self.length
        return max((p for p in self._checkpoints if p <= n), default=0)

    def checkpoint(self) -> None:
        """Keep the committed states at this length (compact copies where they are views into a step's
        per-position states); the oldest checkpoint goes beyond `max_checkpoints`."""
        if not self.max_checkpoints or not self.length or self.pending:
            return

        def own(t: torch.Tensor) -> torch.Tensor:
            return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()

        self._exact()
        self._checkpoints[self.length] = ([own(c) for c in self._conv], [own(s) for s in self._ssm])
        self._checkpoints.move_to_end(self.length)
        while len(self._checkpoints) > self.max_checkpoints:
            self._checkpoints.popitem(last=False)

    def set_states(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Committed states of every GDN layer from [layers, K-1, C] and [layers, Hv, Dk, Dv] (a slot file)."""
        if tuple(conv.shape) != (self.num_gdn_layers, *self._conv_shape) or \
                tuple(ssm.shape) != (self.num_gdn_layers, *self._ssm_shape):
            raise TurboSpecError("the recurrent states do not match this model's layers")
        self._conv = [c.to(self.dtype).clone() for c in conv]
        self._ssm = [s.float().clone() for s in ssm]
        self._loose = False

    @property
    def checkpoints(self) -> list[int]:
        """Lengths with kept states, oldest first."""
        return list(self._checkpoints)

    def reset(self) -> None:
        self._checkpoints.clear()
        self.kv.reset()
        self._zero_states()
        self.pending = 0
        self._parents = None
        self._windows = [None] * len(self._windows)
        self._states = [None] * len(self._states)

    # ---- memory accounting -----------------------------------------------------------------------------
    @property
    def attention_kv_bytes(self) -> int:
        return self.kv.nbytes

    @property
    def conv_state_bytes(self) -> int:
        return self.num_gdn_layers * math.prod(self._conv_shape) * self.dtype.itemsize

    @property
    def ssm_state_bytes(self) -> int:
        return self.num_gdn_layers * math.prod(self._ssm_shape) * 4

    @property
    def recurrent_state_bytes(self) -> int:
        """Conv + recurrent (SSM) state of all GDN layers for one sequence (independent of context length)."""
        return self.conv_state_bytes + self.ssm_state_bytes

    def scratch_bytes(self, n: int) -> int:
        """Transient bytes a step of n tokens allocates for rollback (per-position recurrent states). The committed
        state is a view into the last step's outputs, so up to two steps' worth are alive at once."""
        per_state = self.ssm_state_bytes
        kept = n if n <= self.rollback_limit else 1
        return per_state * kept + self.dtype.itemsize * self.num_gdn_layers * n * self._conv_shape[1]

    @property
    def nbytes(self) -> int:
        """Attention KV, the committed states and room for `max_checkpoints` more."""
        return self.attention_kv_bytes + self.recurrent_state_bytes * (1 + self.max_checkpoints)

    def bytes_per_token(self) -> int:
        """Attention KV bytes per context token (the recurrent state does not grow with context)."""
        return self.kv.bytes_per_token()

    def memory_report(self) -> dict[str, int]:
        return {
            "attention_kv_bytes": self.attention_kv_bytes,
            "conv_state_bytes": self.conv_state_bytes,
            "ssm_state_bytes": self.ssm_state_bytes,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "nbytes": self.nbytes,
        }
