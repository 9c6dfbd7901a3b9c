"""Paged KV: one pool of fixed-size blocks of positions shared by many sequences, a block table per sequence.

`BlockPool` holds K and V of every layer for `num_blocks * block` positions in any KV format (plain f16/bf16/f32
or packed q8_0/q4_0/tbq4_0/turbo*, K and V independently), a free list and per-block reference counts.
`PagedSequence` is one sequence's positions in the pool: the cache contract of `kv.base.Cache` (begin / commit(keep)
/ reset / truncate / length) over a block table instead of one preallocated buffer. `PagedBatch` is one step's rows
from many sequences: it stores their K/V and runs their attention, decode rows of every sequence in one kernel call
(`kernels.attention.paged`, or on a GPU `kernels.triton_attention.paged`, which read the block tables) and
multi-row segments (prefill chunks) one by one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from turbospec.errors import TurboSpecError
from turbospec.kernels import attention as fused
from turbospec.kernels import encode as encoder
from turbospec.kernels import gpu
from turbospec.kernels import triton_attention as gpu_attention
from turbospec.kernels import triton_encode as gpu_encode
from turbospec.kv import kernel_args
from turbospec.kv.formats import KVFormat, Packed, PlainFormat, get_format
from turbospec.kv.plan import AttentionPlan, tree_positions
from turbospec.kv.query_rounding import key_block, round_queries

Key = tuple  # (hash of the previous block's key or 0, the block's tokens)
BLOCK = 256  # positions per block; equal to the attention kernel's tile, so a decode row's arithmetic is the same
# whether its positions are paged or contiguous
STEP_ROWS = 16  # segments of up to this many rows attend row by row in the C++ paged kernel (chain / tree verification)


class OutOfBlocks(TurboSpecError):
    """The pool has fewer free blocks than a sequence needs (the scheduler preempts or waits)."""


class BlockPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, *, k_type: str,
                 v_type: str, block: int = BLOCK):
        if num_blocks < 1 or block < 1:
            raise TurboSpecError("a KV pool needs at least one block of at least one position")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block = num_blocks, block
        self.k_fmt: KVFormat = get_format(k_type)
        self.v_fmt: KVFormat = get_format(v_type)
        lead = (num_layers, num_kv_heads, num_blocks * block)
        self.k: Packed = self.k_fmt.allocate(head_dim, lead)
        self.v: Packed = self.v_fmt.allocate(head_dim, lead)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids go out first
        self.refs = [0] * num_blocks
        # prefix cache: blocks known by the key of their tokens, (hash of the previous block's key, tokens) — full
        # blocks, and the last, partly filled block of a finished sequence; a cached block no sequence holds stays
        # readable until it is evicted (least recently released first)
        self._by_key: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        self._children: dict[int, set[int]] = {}  # previous block's key hash -> cached blocks that follow it
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # ---- blocks -----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Full blocks known to the prefix cache (held by sequences or not)."""
        return len(self._by_key)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"KV pool exhausted: {n} blocks needed, {self.num_free} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently released cached block
                b, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(b)
                del self._by_key[key]
                self._children[key[0]].discard(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than allocated")

    def remember(self, block: int, key: Key) -> None:
        """Block `block` holds the positions that `key` names (all of them when full): later prompts may share it
        (a full block) or copy the start of it (any block)."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key
            self._children.setdefault(key[0], set()).add(block)

    def lookup(self, key: Key) -> int | None:
        return self._by_key.get(key)

    def children(self, prev: int) -> list[tuple[int, tuple[int, ...]]]:
        """(block, its tokens) of the cached blocks that follow the block whose key hashes to `prev` (0: none)."""
        return [(b, self._key_of[b][1]) for b in self._children.get(prev, ())]

    def copy_start(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of block src into block dst (a sequence continues a cached partial block in
        a block of its own)."""
        pos = torch.arange(n, dtype=torch.int64)
        self.move(src * self.block + pos, dst * self.block + pos)

    def share(self, block: int) -> None:
        """One more sequence holds cached block `block`."""
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1

    # ---- storage ----------------------------------------------------------------------------------------
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Encode k, v [KVH, N, D] into the physical positions `slots` (int64 [N]) of `layer` (plain formats: a copy,
        as the contiguous `KVCache` stores them)."""
        specs = self._encode_specs if k.shape[0] * k.shape[1] <= encoder.MAX_ROWS else (None, None)
        gpu_sides = self._gpu_encode if gpu.enabled("encode") else (None, None)
        for fmt, buf, x, spec, on_gpu in ((self.k_fmt, self.k, k, specs[0], gpu_sides[0]),
                                          (self.v_fmt, self.v, v, specs[1], gpu_sides[1])):
            if isinstance(fmt, PlainFormat):
                buf["data"][layer].index_copy_(1, slots, x.to(buf["data"].dtype))
                continue
            # the C++ encoder where it is here, for as many rows as QuantKVCache.store gives it: the same bytes
            if spec is not None and encoder.encode_slots(x, spec, [buf[f][layer] for f in spec.fields], slots):
                continue
            if on_gpu is not None:  # Triton on a GPU: the same bytes (turbo*: up to a codebook boundary)
                kind, fields, turbo = on_gpu
                try:
                    gpu_encode.encode_into(x, kind, fields[layer], 0, turbo, slots)
                    continue
                except Exception as e:  # noqa: BLE001 -- a Triton that cannot build it: the torch encoder
                    gpu.failed("encode", e)
            for name, t in fmt.encode(x).items():
                buf[name][layer].index_copy_(1, slots, t.to(buf[name].dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at physical positions `slots` [T] of `layer`, [KVH, T, D]: the stored tensors for plain formats
        (their dtype), decoded float32 otherwise; K in the rotated domain ([KVH, T, padded D]) where queries are
        rounded there (`rotated_queries`)."""
        out = []
        for side, (fmt, buf) in enumerate(((self.k_fmt, self.k), (self.v_fmt, self.v))):
            fields = Packed({name: t[layer].index_select(1, slots) for name, t in buf.items()}, dim=self.head_dim)
            if len(fields) == 1 and "data" in fields:
                out.append(fields["data"])
            elif side == 0 and self.rotated_queries:
                out.append(fmt.decode_rotated(fields))
            else:
                out.append(fmt.decode(fields, self.head_dim))
        return out[0], out[1]

    @cached_property
    def rotated_queries(self) -> bool:
        """Whether queries are rounded to 8 bits in the keys' rotated domain (turbo3/turbo4 keys): `gather` gives K
        rotated and the torch paths rotate q (`queries`) before rounding it, as the kernels read them."""
        return self.q_block is not None and self.k_fmt.rotated

    def queries(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
        """q [..., D] as the torch paths multiply it with `gather`'s K, and the SDPA scale that goes with it:
        against integer keys scaled and rounded to 8 bits per key block (after the rotation for turbo keys, at the
        padded width), else unchanged with `scale`."""
        if self.q_block is None:
            return q, scale
        qf = q.float()
        if self.rotated_queries:
            qf = kernel_args.rotate_fast(qf.contiguous())
        return round_queries(qf * scale, self.q_block), 1.0

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy physical positions src -> dst (int64 [n]) in every layer (commit of a draft tree's path)."""
        for buf in (*self.k.values(), *self.v.values()):
            buf.index_copy_(2, dst, buf.index_select(2, src))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    @cached_property
    def q_block(self) -> int | None:
        """The key block over which queries are rounded to 8 bits (integer keys; turbospec.kv.query_rounding)."""
        return key_block(self.k_fmt, self.head_dim)

    # ---- the decode kernel ------------------------------------------------------------------------------
    def step_args(self, layer: int) -> tuple | None:
        """The K and V arguments of the one-call attention of decode rows (`attn_paged_rows` in kernels/gemv.cpp:
        per format its ints, tables and this layer's buffers), or None when a format has no C++ encoder or
        attention path here."""
        sides = self._step_sides
        return None if sides is None else sides[layer]

    @cached_property
    def _step_sides(self) -> list[tuple] | None:
        return kernel_args.step_sides(self.k_fmt, self.v_fmt, self.head_dim, self.k, self.v, self.num_layers)

    @cached_property
    def _gpu_encode(self) -> tuple:
        return kernel_args.triton_encoders(self.k_fmt, self.v_fmt, self.head_dim, self.k, self.v, self.num_layers)

    @cached_property
    def _encode_specs(self) -> tuple:
        return kernel_args.encode_specs(self.k_fmt, self.v_fmt, self.head_dim)

    @cached_property
    def triton_specs(self):
        """(K spec, V spec) of the Triton paged attention (a pool on a GPU), or None."""
        return kernel_args.triton_specs(self.k_fmt, self.v_fmt, self.head_dim, next(iter(self.k.values())))

    @cached_property
    def kernel_specs(self):
        """(K spec, V spec) of the paged attention kernel, or None (no kernel here, or a format it cannot read)."""
        ks = kernel_args.attention_spec(self.k_fmt, self.head_dim)
        vs = kernel_args.attention_spec(self.v_fmt, self.head_dim)
        return (ks, vs) if ks is not None and vs is not None and fused.load() is not None else None

    def __repr__(self) -> str:
        return (f"<BlockPool K {self.k_fmt.name} V {self.v_fmt.name}: {self.num_blocks} blocks x {self.block} "
                f"positions, {self.nbytes / 2**20:.1f} MiB>")


class PagedSequence:
    """One sequence's committed positions (then `pending` scratch positions) in a `BlockPool`."""

    prefix_reusable = True

    def __init__(self, pool: BlockPool, max_len: int):
        self.pool = pool
        self.max_len = max_len
        self.blocks: list[int] = []
        self.length = 0
        self.pending = 0

    def can_grow(self, n: int) -> bool:
        """Whether `begin(n)` would find enough free blocks."""
        return self.pool.blocks_for(self.length + n) - len(self.blocks) <= self.pool.num_free

    def begin(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise TurboSpecError(
                f"context full: {self.length} cached + {n} new tokens > context size {self.max_len} (raise -c)")
        need = self.pool.blocks_for(self.length + n) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.allocate(need)
        self.pending = n

    def slot(self, position: int) -> int:
        """The physical position of logical `position`."""
        b = self.pool.block
        return self.blocks[position // b] * b + position % b

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Physical positions of logical positions [start, end), int64."""
        if end - start == 1:
            return torch.tensor([self.slot(start)], dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(self.blocks, dtype=torch.int64)
        b = self.pool.block
        return table[pos // b] * b + pos % b

    def commit(self, keep: list[int] | None = None) -> None:
        if keep is None:
            self.length += self.pending
        else:
            if keep != list(range(len(keep))):
                src = self.slots(self.length, self.length + self.pending)[torch.tensor(keep, dtype=torch.int64)]
                self.pool.move(src, self.slots(self.length, self.length + len(keep)))
            self.length += len(keep)
        self.pending = 0
        self._trim()

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)
        self.pending = 0
        self._trim()

    def reset(self) -> None:
        self.truncate(0)

    def resume_point(self, n: int) -> int:
        return max(0, min(n, self.length))

    def checkpoint(self) -> None:
        pass

    def _trim(self) -> None:
        """Give back the blocks past the committed positions."""
        keep = self.pool.blocks_for(self.length)
        if len(self.blocks) > keep:
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.bytes_per_block

    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_block // self.pool.block


@dataclass
class Segment:
    """Rows [row, row + n) of a step belong to `seq`, placed by `plan` (after seq.length committed positions)."""

    seq: PagedSequence
    row: int
    n: int
    plan: AttentionPlan


class PagedBatch:
    """One forward's rows from many sequences (the `cache` a model's forward gets; `plan` is `self.plan`).

    Every segment's sequence is begun here (blocks allocated for its new rows); `commit()` commits them all.
    The rows of segments of up to STEP_ROWS rows (decode, chain and tree verification; with the C++ kernel) attend
    in one paged-kernel call; the others (prefill chunks) one by one over their gathered positions."""

    def __init__(self, pool: BlockPool, segments: list[Segment]):
        self.pool = pool
        self.segments = segments
        self.n = sum(s.n for s in segments)
        for s in segments:
            if s.plan.start != s.seq.length or s.plan.n != s.n:
                raise ValueError("a segment's plan does not match its sequence")
            s.seq.begin(s.n)
        if len(segments) == 1 and segments[0].plan.first is not None:  # one sequence's consecutive positions
            p = segments[0].plan  # (RoPE then takes slices of its tables)
            self.plan = AttentionPlan(None, 0, first=p.first, n=p.n)
        else:
            positions: list[int] = []
            for s in segments:
                p = s.plan
                if p.first is not None:
                    positions += range(p.first, p.first + p.n)
                elif p.parents is not None:  # a draft tree (from its parents: no read of a device tensor)
                    positions += tree_positions(p.start, p.parents)
                else:
                    positions += p.positions.tolist()
            self.plan = AttentionPlan(torch.tensor(positions, dtype=torch.int64), 0)
        if all(s.n == 1 for s in segments):
            self.slots = torch.tensor([s.seq.slot(s.seq.length) for s in segments], dtype=torch.int64)
        else:
            self.slots = torch.cat([s.seq.slots(s.seq.length, s.seq.length + s.n) for s in segments])
        # step rows: every row of a segment of at most `step_rows` (a decode row; with the C++ kernel also a chain
        # or tree of drafts to verify or a short prompt chunk) attends as a decode row over its sequence's positions
        # up to its own, in one paged-kernel call for all of them -- for a chain the arithmetic of the single-token
        # steps that decode those rows; a tree's rows skip the positions of the tree's other branches (`masks`).
        # (On a GPU the longer segments and trees read their committed positions once for all their rows instead:
        # `_segment_triton`.)
        self.step_rows = STEP_ROWS if pool.kernel_specs is not None else 1
        steps = [s for s in segments if self._step(s)]
        rows = self._rows = [(s, i) for s in steps for i in range(s.n)]  # (segment, row in it) of every step row
        self.others = [s for s in segments if not self._step(s)]
        self.decode_only = bool(steps) and not self.others  # the one-call attention's case
        self.masks: torch.Tensor | None = None
        if steps:
            width = max(len(s.seq.blocks) for s in steps)
            padded = {id(s): s.seq.blocks + [-1] * (width - len(s.seq.blocks)) for s in steps}
            self.tables = torch.tensor([padded[id(s)] for s, _ in rows], dtype=torch.int32)  # one call, not S
            lens = [s.seq.length + i + 1 for s, i in rows]
            self.lens = torch.tensor(lens, dtype=torch.int64)
            self.longest = max(lens)
            # a draft tree's row i attends over its segment's rows 0..i to its ancestors alone: bit k of its mask
            # set where row i - k is one (or itself); None where every step row is causal
            trees = {id(s): _ancestor_masks(s.plan.parents) for s in steps if s.plan.mask is not None}
            self.masks = torch.tensor([trees[id(s)][i] if id(s) in trees else -1 for s, i in rows],
                                      dtype=torch.int64) if trees else None

    @cached_property
    def _decode_rows(self) -> torch.Tensor:
        """The step rows' indices among the batch's rows (a step that mixes them with prompt chunks; made once)."""
        return torch.tensor([s.row + i for s, i in self._rows], dtype=torch.int64)

    def _step(self, s: Segment) -> bool:
        """Whether segment s's rows attend as decode rows (at most `step_rows` of them; a draft tree's with their
        masks, in the C++ kernel)."""
        return s.n <= self.step_rows and (s.plan.mask is None or (self.step_rows > 1 and s.plan.parents is not None))

    # the Cache protocol, as far as a model's forward uses it
    def begin(self, n: int) -> None:
        if n != self.n:
            raise ValueError(f"the batch has {self.n} rows, the forward {n}")

    def commit(self, keeps: dict[int, list[int]] | None = None) -> None:
        """Commit every segment's rows, or for segment i in `keeps` only the listed rows (its accepted path)."""
        for i, s in enumerate(self.segments):
            s.seq.commit(keeps.get(i) if keeps else None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store the rows' k/v [KVH, N, D] and attend q [H, N, D] -> [H, N, D] in q's dtype."""
        pool = self.pool
        pool.store(layer, k, v, self.slots)
        h, n, d = q.shape
        kvh = k.shape[0]
        g = h // kvh
        if not self.others:  # decode rows only (the common step): rows in order, no scatter
            return self._decode(layer, q, kvh, g, d, scale).to(q.dtype)
        out = torch.empty_like(q)
        if self._rows:
            rows = self._decode_rows
            out[:, rows] = self._decode(layer, q[:, rows], kvh, g, d, scale).to(q.dtype)
        for s in self.others:
            rows = slice(s.row, s.row + s.n)
            o = self._segment_triton(layer, q[:, rows], s, kvh, g, d, scale)
            if o is not None:
                out[:, rows] = o
                continue
            keys, values = pool.gather(layer, s.seq.slots(0, s.seq.length + s.n))
            qs, sdpa_scale = pool.queries(q[:, rows], scale)  # integer keys: q rounded as the kernels round it
            if not keys.dtype == values.dtype == qs.dtype:
                qs, keys, values = qs.float(), keys.float(), values.float()
            if s.plan.mask is None and qs.device.type == "cpu" and qs.shape[-1] == values.shape[-1]:
                # a prompt chunk: torch's flash kernel by blocks
                o = fused.prefill_rows(qs, keys, values, keys.shape[1] - s.n, sdpa_scale)
                if o is not None:
                    out[:, rows] = o.to(q.dtype)
                    continue
            mask, causal = s.plan.sdpa_mask(qs.device)
            o = F.scaled_dot_product_attention(qs.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                               attn_mask=mask, is_causal=causal, enable_gqa=g > 1,
                                               scale=sdpa_scale)[0]
            out[:, rows] = o.to(q.dtype)
        return out

    def _segment_triton(self, layer: int, q: torch.Tensor, s: Segment, kvh: int, g: int, d: int,
                        scale: float) -> torch.Tensor | None:
        """A multi-row segment (verification rows, a prefill chunk after earlier positions) on a GPU: its committed
        positions [0, L) in one Triton launch through its block table (no copy of them), its own n positions in
        torch with the plan's mask, the two softmax states merged. q [H, n, D] -> [H, n, D] in q's dtype; None
        where this does not apply (not a GPU pool, nothing committed, more rows than the kernel takes)."""
        pool = self.pool
        specs = pool.triton_specs
        start, n = s.seq.length, s.n
        if specs is None or start == 0 or g * n > gpu_attention.MAX_ROWS or pool.kernel_specs is not None:
            return None
        kf, vf = pool.k_fmt, pool.v_fmt
        qf = q.to(torch.float32).reshape(kvh, g * n, d)
        if kf.rotated:
            qf = kernel_args.rotate_fast(qf)
        qf = round_queries(qf * scale, pool.q_block)
        kw, vw = kf.padded_dim(d), vf.padded_dim(d)
        ks, vs = specs
        used = pool.blocks_for(start)
        table = torch.tensor([s.seq.blocks[:used]], dtype=torch.int32, device=q.device)
        lens = torch.tensor([start], dtype=torch.int64, device=q.device)
        m, lsum, acc = gpu_attention.partial(
            qf if qf.shape[-1] == kw else F.pad(qf, (0, kw - qf.shape[-1])), ks, [pool.k[f][layer] for f in ks[2]],
            vs, [pool.v[f][layer] for f in vs[2]], vw, 0, start, (table, lens, kvh, pool.block))
        if not vf.rotated and vw != d:
            acc = acc[..., :d]
        # the segment's own positions, decoded as the kernel reads them (rotated formats in the rotated domain)
        slots = s.seq.slots(start, start + n).to(q.device)
        kp = Packed({f: t[layer].index_select(1, slots) for f, t in pool.k.items()}, dim=d)
        vp = Packed({f: t[layer].index_select(1, slots) for f, t in pool.v.items()}, dim=d)
        kb = kf.decode_rotated(kp) if kf.rotated else kf.decode(kp, d)
        vb = vf.decode_rotated(vp) if vf.rotated else vf.decode(vp, d)
        mask = s.plan.mask[:, start:start + n].to(q.device) if s.plan.mask is not None else None
        out = gpu_attention.with_own_rows(m, lsum, acc, qf, kb.float(), vb.float(), mask, g)
        if vf.rotated:
            out = kernel_args.rotate_fast(out, inverse=True, dim=d)
        return out.reshape(kvh * g, n, d).to(q.dtype)

    def _decode(self, layer: int, q: torch.Tensor, kvh: int, g: int, d: int, scale: float) -> torch.Tensor:
        """q [H, S, D] (one row per sequence) -> [H, S, D] float32 through the paged kernel (C++ on the CPU, Triton
        on a GPU; torch without either)."""
        pool = self.pool
        s = q.shape[1]
        qf = q.to(torch.float32).reshape(kvh, g, s, d).permute(2, 0, 1, 3)  # [S, KVH, G, D]
        specs = pool.kernel_specs or pool.triton_specs
        if specs is None:
            qs, sdpa_scale = pool.queries(qf, scale)
            return self._decode_torch(layer, qs * sdpa_scale, d)
        kf, vf = pool.k_fmt, pool.v_fmt
        if kf.rotated:
            qf = kernel_args.rotate_fast(qf.contiguous())
        qf = qf * scale
        kw, vw = kf.padded_dim(d), vf.padded_dim(d)
        if qf.shape[-1] != kw:
            qf = F.pad(qf, (0, kw - qf.shape[-1]))
        ks, vs = specs
        k_fields, v_fields = [pool.k[f][layer] for f in ks[2]], [pool.v[f][layer] for f in vs[2]]
        if pool.kernel_specs is None:  # Triton: integer keys' queries rounded here (the C++ kernel rounds them itself)
            o = gpu_attention.paged(round_queries(qf, pool.q_block).contiguous(), ks, k_fields, vs, v_fields, vw,
                                    self.tables, self.lens, pool.block, self.longest)
        else:
            o = fused.paged(qf.contiguous(), ks, k_fields, vs, v_fields, vw, self.tables, self.lens, pool.block,
                            self.masks)
        if vf.rotated:
            o = kernel_args.rotate_fast(o, inverse=True, dim=d)
        elif vw != d:
            o = o[..., :d]
        return o.permute(1, 2, 0, 3).reshape(kvh * g, s, d)

    def _decode_torch(self, layer: int, qf: torch.Tensor, d: int) -> torch.Tensor:
        outs = []
        rows = self._rows
        for j, (s, i) in enumerate(rows):
            keys, values = self.pool.gather(layer, s.seq.slots(0, s.seq.length + i + 1))
            sc = torch.matmul(qf[j], keys.float().transpose(-1, -2))  # [KVH, G, D] x [KVH, D, T]: [KVH, G, T]
            outs.append(torch.matmul(torch.softmax(sc, -1), values.float()))
        kvh, g = qf.shape[1], qf.shape[2]
        return torch.stack(outs).permute(1, 2, 0, 3).reshape(kvh * g, len(rows), d)


def _ancestor_masks(parents: list[int]) -> list[int]:
    """Per node of a tree in topological order (parents[i] < i, -1: a root): bit k set where node i - k is the
    node or one of its ancestors, or lies before the tree (k > i), for k < 64; as int64s (bit 63 set: negative)."""
    full = (1 << 64) - 1
    nodes: list[int] = []  # bit k: node i - k is node i or an ancestor
    for i, p in enumerate(parents):
        if i >= 64:
            raise ValueError("a tree of more than 64 rows has no 64-bit masks")
        nodes.append(1 | ((nodes[p] << (i - p)) if p >= 0 else 0))
    masks = [(m | (full << (i + 1))) & full for i, m in enumerate(nodes)]
    return [m - (1 << 64) if m >> 63 else m for m in masks]


def pool_for(model, positions: int, k_type: str | None, v_type: str | None, block: int = BLOCK, *,
             layers: int | None = None, mem: int | None = None, reserved: int = 0) -> BlockPool:
    """A pool for `model`'s attention layers (`layers`, default all of them) in K/V formats by name (None: the
    model's dtype): room for `positions` positions (rounded up to blocks), or as many blocks as fit in `mem` MiB
    after `reserved` bytes (a hybrid's recurrent states)."""
    from turbospec.dtypes import short_name

    c = model.cfg
    dt = short_name(model.dtype)
    def make(blocks: int) -> BlockPool:
        return BlockPool(layers if layers is not None else c.num_layers, c.num_kv_heads, c.head_dim, blocks,
                         k_type=k_type or dt, v_type=v_type or dt, block=block)

    if mem is None:
        return make(max(1, math.ceil(positions / block)))
    per_block = make(1).nbytes
    n = (mem * 2**20 - reserved) // per_block
    if n < 1:
        raise TurboSpecError(f"--cache-mem {mem} MiB leaves no room for a KV block ({per_block / 2**20:.2f} MiB per "
                             f"{block} positions, {reserved / 2**20:.2f} MiB of recurrent states reserved)")
    return make(n)
