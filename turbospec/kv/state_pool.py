"""Recurrent states of a hybrid model's Gated DeltaNet layers for continuous batching.

`StatePool` holds one slot per running sequence (the conv state [K-1, C] and the recurrent state [Hv, Dk, Dv]
float32 of every GDN layer) and a bounded, least-recently-used set of snapshots: the states after a full KV block
of the prefix cache, so that a prompt that starts with cached blocks resumes from the last one with a snapshot
instead of re-processing it. A slot holds references to tensors that nothing writes to again (a one-row step's
outputs, or the copy of the kept row's state of a longer step), so taking a snapshot copies nothing. A longer step's
per-row states are written into buffers the step before used (`buffer`, `give_back`): once committed, nothing else
refers to them.

`HybridBatch` is the cache of one batched forward of a hybrid model: attention layers see its `kv` (a
`PagedBatch`), Gated DeltaNet layers run segment by segment over `segments` and stash each segment's window and
states; `commit()` commits both.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from turbospec.errors import TurboSpecError
from turbospec.kv.hybrid_cache import kept_state
from turbospec.kv.paged import PagedBatch, Segment

States = tuple[list[torch.Tensor], list[torch.Tensor]]  # conv and recurrent state of every GDN layer
_NONE = torch.empty(0)  # no buffer: the kernel makes new states


class StatePool:
    def __init__(self, num_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 dtype: torch.dtype, slots: int, snapshots: int, *, per_owner: int = 3, rollback_limit: int = 16):
        if slots < 1 or snapshots < 0:
            raise TurboSpecError("a state pool needs at least one slot and a non-negative snapshot count")
        self.num_layers, self.dtype = num_layers, dtype
        self.conv_shape, self.ssm_shape = tuple(conv_shape), tuple(ssm_shape)
        self.num_slots, self.max_snapshots = slots, snapshots
        self.per_owner = per_owner  # snapshots one sequence keeps (its newest)
        self.rollback_limit = rollback_limit  # steps up to this many rows use the token-by-token recurrence
        self._states: list[States | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._snapshots: OrderedDict[object, States] = OrderedDict()  # key -> states, least recently used first
        self._owner: dict[object, int] = {}  # snapshot key -> id of the sequence that took it
        self.snapshot_hits = 0
        # rows -> float32 [rows, *ssm_shape] buffers of the last step's per-row recurrent states (a verification's),
        # which the next step's Gated DeltaNet layers write again: fresh ones cost a page fault per 4 KiB each step
        self._spare: dict[int, list[torch.Tensor]] = {}

    # ---- per-row states of a step ------------------------------------------------------------------------
    def buffer(self, rows: int) -> torch.Tensor:
        """Where a Gated DeltaNet layer may write a step's states after each of its `rows` rows: a buffer the last
        step gave back, or an empty tensor (the kernel makes a new one)."""
        spare = self._spare.get(rows)
        return spare.pop() if spare else _NONE

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """A committed step's per-row state buffers, for the next step; they replace the spare ones this step did
        not take (so at most one step's buffers are kept)."""
        spare: dict[int, list[torch.Tensor]] = {}
        for b in buffers:
            spare.setdefault(b.shape[0], []).append(b)
        self._spare = spare

    def keep_spare(self, wanted: dict[int, int]) -> None:
        """At a step's start: of the spare buffers, keep only as many of each row count as the step can take
        (`wanted`: rows -> buffers), so that what it cannot use is not held beside the states it makes."""
        self._spare = {n: bs[:wanted[n]] for n, bs in self._spare.items() if wanted.get(n)}

    # ---- slots ------------------------------------------------------------------------------------------
    def acquire(self) -> int:
        if not self._free:
            raise TurboSpecError(f"no free recurrent-state slot ({self.num_slots} in use)")
        slot = self._free.pop()
        self._states[slot] = self.zeros()
        return slot

    def release(self, slot: int) -> None:
        if self._states[slot] is None:
            raise RuntimeError(f"state slot {slot} released twice")
        self._states[slot] = None
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def zeros(self) -> States:
        return ([torch.zeros(self.conv_shape, dtype=self.dtype) for _ in range(self.num_layers)],
                [torch.zeros(self.ssm_shape, dtype=torch.float32) for _ in range(self.num_layers)])

    def get(self, slot: int) -> States:
        st = self._states[slot]
        if st is None:
            raise RuntimeError(f"state slot {slot} is not in use")
        return st

    def set(self, slot: int, states: States) -> None:
        self._states[slot] = states

    # ---- snapshots --------------------------------------------------------------------------------------
    def snapshot(self, key: object, slot: int, owner: int) -> None:
        """Keep slot's states as the states after the tokens `key` names; an owner keeps its `per_owner` newest
        snapshots, and the pool its `max_snapshots` most recently used."""
        if self.max_snapshots == 0 or self.per_owner == 0 or key in self._snapshots:
            return
        mine = [k for k, o in self._owner.items() if o == owner]
        for k in mine[:max(0, len(mine) - self.per_owner + 1)]:
            self._drop(k)
        conv, ssm = self.get(slot)
        self.put(key, (list(conv), list(ssm)), owner)

    def put(self, key: object, states: States, owner: int = -1) -> None:
        """Keep `states` as a snapshot (the least recently used goes when the pool is full)."""
        if self.max_snapshots == 0:
            return
        self._snapshots.pop(key, None)
        self._owner.pop(key, None)
        while len(self._snapshots) >= self.max_snapshots:
            self._drop(next(iter(self._snapshots)))
        self._snapshots[key] = states
        self._owner[key] = owner

    def states_of(self, key: object) -> States:
        return self._snapshots[key]

    def has(self, key: object) -> bool:
        return key in self._snapshots

    def snapshot_keys(self) -> list:
        return list(self._snapshots)

    def restore(self, key: object, slot: int) -> None:
        """Slot's states become the snapshot's (which stays, now the most recently used, owned by no one)."""
        conv, ssm = self._snapshots[key]
        self._snapshots.move_to_end(key)
        self._owner[key] = -1
        self._states[slot] = (list(conv), list(ssm))
        self.snapshot_hits += 1

    def _drop(self, key: object) -> None:
        del self._snapshots[key]
        del self._owner[key]

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    # ---- memory -----------------------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """One sequence's conv + recurrent states (all GDN layers)."""
        return state_bytes(self.num_layers, self.conv_shape, self.ssm_shape, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of every slot and snapshot when all are in use (what the budget reserves)."""
        return (self.num_slots + self.max_snapshots) * self.state_bytes

    def __repr__(self) -> str:
        return (f"<StatePool {self.num_slots} slots + {self.max_snapshots} snapshots x "
                f"{self.state_bytes / 2**20:.2f} MiB>")


def state_bytes(num_layers: int, conv_shape, ssm_shape, dtype: torch.dtype) -> int:
    return num_layers * (math.prod(conv_shape) * dtype.itemsize + math.prod(ssm_shape) * 4)


class HybridBatch:
    """One batched forward of a hybrid model: `kv` for the attention layers, per-segment states for the GDN ones."""

    def __init__(self, kv: PagedBatch, states: StatePool, slots: list[int]):
        if len(slots) != len(kv.segments):
            raise ValueError("one state slot per segment")
        self.kv, self.states, self.slots = kv, states, slots
        self.segments: list[Segment] = kv.segments
        self.plan = kv.plan
        n = states.num_layers
        self._stash: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[None] * n for _ in slots]
        wanted: dict[int, int] = {}
        for seg in self.segments:
            if seg.n > 1:
                wanted[seg.n] = wanted.get(seg.n, 0) + n
        states.keep_spare(wanted)
        self._took = False  # whether the step's layers asked for buffers (the C++ recurrence): then they go back

    def begin(self, n: int) -> None:
        self.kv.begin(n)

    def all_states(self, i: int) -> bool:
        """Whether segment i's step keeps the state after every row (the token-by-token form, as a lone sequence's
        step of that many rows does)."""
        return self.segments[i].n <= self.states.rollback_limit

    def parents(self, i: int) -> list[int] | None:
        """Segment i's tree (parents of its rows; None: a chain)."""
        return self.segments[i].plan.parents

    def gdn_state(self, i: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv, ssm = self.states.get(self.slots[i])
        return conv[layer], ssm[layer]

    def buffer(self, i: int) -> torch.Tensor:
        """Where segment i's Gated DeltaNet states after each row may go (`StatePool.buffer`; a lone row's state
        becomes its slot's own: always new)."""
        n = self.segments[i].n
        if n == 1:
            return _NONE
        self._took = True
        return self.states.buffer(n)

    def gdn_stash(self, i: int, layer: int, window: torch.Tensor, states: torch.Tensor) -> None:
        self._stash[i][layer] = (window, states)

    def commit(self, keeps: dict[int, list[int]] | None = None) -> None:
        """Commit every segment, or for segment i in `keeps` only its listed rows (an accepted root path: the
        states after its last node, the conv rows along it)."""
        self.kv.commit(keeps)
        spare: list[torch.Tensor] = []  # the per-row state buffers, for the next step
        for i, slot in enumerate(self.slots):
            stash = self._stash[i]
            if any(x is None for x in stash):
                raise TurboSpecError("commit before every Gated DeltaNet layer ran its step")
            n = self.segments[i].n
            keep = (keeps.get(i) if keeps else None) or list(range(n))
            conv, ssm = [], []
            for w, st in stash:  # type: ignore[misc]
                c, s = kept_state(w, st, keep, n)
                # one row: views of the step's only state; more: copies of the kept one, so the step's others can go
                # (and the per-row buffer with them, to the next step's layers: no slot or snapshot holds a view of
                # it, as the copy is what the slot keeps)
                conv.append(c.clone() if n > 1 else c)
                ssm.append(s.clone() if st.shape[0] > 1 else s)
                if st.shape[0] > 1 and self._took:
                    spare.append(st)
            self.states.set(slot, (conv, ssm))
        self.states.give_back(spare)
