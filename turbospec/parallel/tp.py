"""Tensor parallelism over `torch.distributed` (gloo on CPU), Megatron's layout as vLLM uses it: each rank holds
1/N of every decoder layer's attention heads (their q/k/v rows, their KV cache), of the Gated DeltaNet's key and
value heads (their projections, conv channels and recurrent states), of the MLP's intermediate columns and of
every MoE expert's (and the shared expert's); the output projections (attention, Gated DeltaNet, MLP down, the
experts' down) multiply the rank's part and an all-reduce sums the parts, once per mixer and once per feed-forward.
The token embedding and the LM head are split by vocabulary rows: a lookup sums the ranks' rows (each rank has
the ids in its range, zeros elsewhere) and the LM head's logits are gathered, so every rank holds the same
whole-vocabulary logits and, with rank 0's seed, picks the same tokens.

Launch with `torchrun` (one process per rank: WORLD_SIZE ranks). Dense, hybrid and MoE models, from safetensors
(each rank reads its slices only) or GGUF (each rank maps the file and keeps its slices), float or packed weights,
every KV format, and the model's MTP layer (sharded the same way).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from turbospec import env
from turbospec.errors import TurboSpecError
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.gated_deltanet import GatedDeltaNet
from turbospec.layers.linear import Linear, LinearRows, RowParallelLinear
from turbospec.layers.moe import MoE, RowParallelMoE
from turbospec.model.config import HYBRID_ARCHS, MOE_ARCHS, ModelConfig
from turbospec.model.decoder import DecoderLayer
from turbospec.model.loader import IndexedSource, WeightSource
from turbospec.weights import (
    consume,
    file_mapping,
    format_of,
    is_packed,
    packable,
    release,
    rows_of,
    trim_heap,
)

# a rank that dies ends the others' collectives with an error, not a hang
TIMEOUT = timedelta(seconds=float(env.get("TURBOSPEC_TP_TIMEOUT", "120")))
# tensor name suffix -> the dimension a rank takes its part of: 0 its output rows (heads, channels, intermediate
# columns), 1 its input columns (the projections whose products are summed over the ranks)
ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
        "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias",
        "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
        ".A_log", ".dt_bias", "experts.gate_proj", "experts.up_proj")
COLUMNS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")
QKV_ROWS = ("in_proj_qkv.weight", "conv1d.weight")  # [q | k | v]: each of the three split by heads
ATTN_QKV_ROWS = ("self_attn.qkv_proj.weight",)  # Phi-3's attention [q | k | v]: query heads, then KV heads
GATE_UP_ROWS = ("experts.gate_up_proj", "mlp.gate_up_proj.weight")  # one [gate | up] (an expert's, Phi-3's MLP): halves
VOCAB = ("embed_tokens.weight", "lm_head.weight")
KV_ROWS = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(timeout: timedelta = TIMEOUT) -> tuple[int, int]:
    """Join the process group that `torchrun` describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with gloo;
    (rank, world size). Without torchrun's variables: (0, 1), nothing initialised."""
    if dist.is_initialized():
        return world()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    dist.init_process_group("gloo", timeout=timeout)
    return world()


def seeded(params):
    """`params` with a seed: its own, else one drawn at random (as the sampler would draw it)."""
    import secrets

    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))


def same_sampling(params):
    """`params` with rank 0's seed on every rank (a request without a seed draws one at random: each rank would
    draw its own and the ranks' tokens, hence their collectives, would part)."""
    seed = [seeded(params).seed]
    dist.broadcast_object_list(seed, src=0)
    return dataclasses.replace(params, seed=seed[0])


def shard_config(cfg: ModelConfig, ranks: int) -> ModelConfig:
    """The config one rank builds: 1/`ranks` of the attention heads, KV heads, MLP width, Gated DeltaNet heads and
    expert widths (one clear error naming what the rank count does not divide)."""
    kv = cfg.num_kv_heads
    if kv < ranks:  # fewer KV heads than ranks: each rank keeps a copy of the one its query heads read (as vLLM)
        if ranks % kv:
            raise TurboSpecError(f"tensor parallel size {ranks} is not a multiple of num_key_value_heads ({kv})")
        kv = ranks
    sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", kv),
             ("intermediate_size", cfg.intermediate_size)]
    raw = dict(cfg.raw)
    if cfg.arch in HYBRID_ARCHS:
        d = cfg.linear_dims()
        sizes += [("linear_num_key_heads", d["num_k_heads"]), ("linear_num_value_heads", d["num_v_heads"])]
    if cfg.arch in MOE_ARCHS:
        m = cfg.moe()
        sizes += [("moe_intermediate_size", m["inter"])]
        if m["shared_inter"]:
            sizes += [("shared_expert_intermediate_size", m["shared_inter"])]
    for name, value in sizes:
        if value % ranks:
            raise TurboSpecError(f"tensor parallel size {ranks} does not divide {name} ({value})")
    for name, value in sizes[3:]:
        raw[name] = value // ranks
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // ranks, num_kv_heads=kv // ranks,
                               intermediate_size=cfg.intermediate_size // ranks, raw=raw)


def vocab_range(vocab: int, rank: int, ranks: int) -> tuple[int, int]:
    """The token ids [lo, hi) whose embedding and LM head rows rank `rank` holds (sizes differ by at most 1)."""
    return rank * vocab // ranks, (rank + 1) * vocab // ranks


class ShardedSource:
    """A `TensorSource` giving rank `rank` of `ranks` its part of every split tensor (`ROWS`, `QKV_ROWS`,
    `COLUMNS`, `VOCAB`) and the others whole. The loaders ask for the local shapes (of `local`, the rank's config;
    the embedding and LM head with the whole vocabulary). A safetensors checkpoint gives the part alone
    (`WeightSource.shard`: a rank reads about 1/N of the layers' bytes); another source (a GGUF file) gives the
    whole tensor, whose part is kept (a view of the file mapping when the part is whole rows)."""

    def __init__(self, source: IndexedSource, rank: int, ranks: int, local: ModelConfig, kv_heads: int | None = None):
        self.source, self.rank, self.ranks, self.local = source, rank, ranks, local
        # ranks sharing one KV head (the whole model's `kv_heads` fewer than the ranks), else 1
        self.kv_copies = ranks // kv_heads if kv_heads is not None and kv_heads < ranks else 1

    def __getattr__(self, name: str):  # names, has, expert_budget, ...: the source's own
        return getattr(self.source, name)

    def _split(self, name: str, shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]], tuple[int, ...]] | None:
        """(dim, the rank's [start, stop) ranges along it, the whole tensor's shape) for a split tensor asked for
        with the rank's `shape`; None for a whole one."""
        if name.endswith(VOCAB):
            lo, hi = vocab_range(shape[0], self.rank, self.ranks)
            return 0, [(lo, hi)], tuple(shape)
        if name.endswith(ATTN_QKV_ROWS):  # (the KV parts as KV_ROWS: shared by `kv_copies` ranks)
            q, kv = self.local.q_size, self.local.kv_size
            heads = self.rank // self.kv_copies, self.ranks // self.kv_copies
            ranges = [(self.rank * q, (self.rank + 1) * q)]
            ranges += [(off + heads[0] * kv, off + (heads[0] + 1) * kv)
                       for off in (q * self.ranks, q * self.ranks + kv * heads[1])]
            return 0, ranges, (q * self.ranks + 2 * kv * heads[1], *shape[1:])
        if name.endswith(QKV_ROWS):
            d = self.local.linear_dims()
            key, value = d["num_k_heads"] * d["k_head_dim"], d["num_v_heads"] * d["v_head_dim"]
            dim, parts = 0, [key, key, value]
        elif name.endswith(GATE_UP_ROWS):
            dim, parts = 0, [shape[0] // 2] * 2
        elif name.endswith(ROWS):
            dim, parts = 0, [shape[0]]
        elif name.endswith(COLUMNS):
            dim, parts = 1, [shape[1]]
        else:
            return None
        part, count = self.rank, self.ranks
        if self.kv_copies > 1 and name.endswith(KV_ROWS):  # the KV head this rank's query heads read
            part, count = self.rank // self.kv_copies, self.ranks // self.kv_copies
        ranges, start = [], 0
        for n in parts:  # each part of the whole tensor is `count` times the rank's, the rank's slice in order
            ranges.append((start + part * n, start + (part + 1) * n))
            start += n * count
        whole = tuple(start if i == dim else s for i, s in enumerate(shape))
        return dim, ranges, whole

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        split = None if shape is None else self._split(name, shape)
        if split is None:
            if shape is None and name.endswith(ROWS + COLUMNS + QKV_ROWS + ATTN_QKV_ROWS + GATE_UP_ROWS + VOCAB):
                raise TurboSpecError(f"{name}: a split tensor is read with its local shape")
            return self.source.get(name, dtype, shape)
        dim, ranges, whole = split
        if isinstance(self.source, WeightSource):  # only the rank's bytes
            return self.source.shard(name, dim, ranges, dtype, whole)
        return _part(self.source.get(name, dtype, whole), dim, ranges)

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        split = self._split(name, shape)
        if split is None:
            return self.source.matrix(name, dtype, shape)
        dim, ranges, whole = split
        pack = self.source.pack
        if isinstance(self.source, WeightSource):
            trim_heap()  # the previous matrix's conversion buffers back to the system (as the source's own matrix)
            if pack is not None and packable(pack, shape):  # quantized from the stored part (--weights)
                return consume(self.source.shard(name, dim, ranges, None, whole), pack)
            return self.source.shard(name, dim, ranges, dtype, whole)
        t = self.source.matrix(name, dtype, whole)
        if self.source.value_tiling(name) != 1:
            raise TurboSpecError(f"{name}: this GGUF file keeps the Gated DeltaNet output projection in llama.cpp's "
                                 f"tiled value-head order, which tensor parallelism cannot split")
        return _part(t, dim, ranges)

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        split = self._split(name, shape)
        if split is None:
            return self.source.expert_matrix(name, index, dtype, shape)
        dim, ranges, whole = split
        return _part(self.source.expert_matrix(name, index, dtype, whole), dim, ranges)


def _part(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """`ranges` of `t` along `dim` (in values; a packed matrix's columns in whole blocks), put together: a view
    when it is one range of rows of a file mapping (its other pages are never touched), else a tensor of its own
    (and the pages of `t` the copy touched, when `t` is a view of a file mapping, leave this process)."""
    if is_packed(t) and dim == 1:
        step = format_of(t).block_values
        if any(a % step or b % step for a, b in ranges):
            raise TurboSpecError(f"a rank's columns of a {format_of(t).name} matrix must be whole {step}-value "
                                 f"blocks; this split is not")
        ranges = [(a // step, b // step) for a, b in ranges]
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    if len(parts) == 1 and dim == 0 and file_mapping(t) is not None:
        return parts[0]
    out = torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)
    release(t)
    return out


def shard_view(group=None) -> Callable[[ModelConfig, IndexedSource], tuple[ModelConfig, ShardedSource]]:
    """The `shard` argument of `turbospec.model.load_model` for this rank of `group`: its config and its view of
    the checkpoint."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)

    def shard(cfg: ModelConfig, source: IndexedSource) -> tuple[ModelConfig, ShardedSource]:
        local = shard_config(cfg, ranks)
        return local, ShardedSource(source, rank, ranks, local, cfg.num_kv_heads)

    return shard


# ---- collectives -------------------------------------------------------------------------------------------------
class GlooCollective:
    """Sums and gathers over `group` with gloo's collectives (any hosts)."""

    def __init__(self, group=None):
        self.group = group
        self.ranks = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (a new tensor)."""
        y = x.clone()
        dist.all_reduce(y, group=self.group)
        return y

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's `x` [..., sizes[rank]] put together along the last dimension, in rank order."""
        pad = max(sizes)
        y = torch.nn.functional.pad(x, (0, pad - x.shape[-1])).contiguous()
        parts = [torch.empty_like(y) for _ in sizes]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` (every rank passes one of the same shape)."""
        y = x.clone()
        dist.broadcast(y, src=0, group=self.group)
        return y


class ShmCollective(GlooCollective):
    """Sums and gathers for ranks on one host through a shared-memory file: each rank copies its part into its
    slot, posts the call's number, waits (spinning) for the others' and reads every slot in rank order, so all
    ranks get the same bits. Two buffers alternate, so a rank may start the next call while another still reads
    this one. About 0.54 ms per sum with gloo over loopback on this 2-core machine (two per decoder layer and
    token) against tens of microseconds here. Tensors larger than the buffer (long prefill chunks) go through
    gloo."""

    def __init__(self, group=None, max_numel: int = 1 << 18, timeout_s: float = TIMEOUT.total_seconds()):
        import secrets
        import tempfile

        super().__init__(group)
        self.max_numel, self.timeout_s = max_numel, timeout_s
        self.rank = dist.get_rank(group)
        name = [f"turbospec-tp-{secrets.token_hex(8)}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(folder, name[0])
        numel = 64 + 2 * self.ranks * max_numel  # 64 int64 flag slots (as float32 pairs), then the buffers
        if self.rank == 0:
            with open(self.path, "wb") as f:
                f.truncate(numel * 4)
        dist.barrier(group=group)
        mem = torch.from_file(self.path, shared=True, size=numel, dtype=torch.float32)
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(self.path)  # the mappings stay; nothing is left behind when the ranks end
        self.flags = mem[:64].view(torch.int64)  # 32 slots: rank i's last posted call number at [i]
        self.data = mem[64:].view(2, self.ranks, max_numel)
        self.calls = 0

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Post `x` (float32 values) in this rank's slot; the call's buffer [ranks, max_numel] once every rank has
        posted."""
        import time

        self.calls += 1
        buf = self.data[self.calls % 2]
        buf[self.rank, :x.numel()].copy_(x.reshape(-1))
        self.flags[self.rank] = self.calls
        deadline = None
        for r in range(self.ranks):
            while int(self.flags[r]) < self.calls:
                os.sched_yield()  # ranks may outnumber cores
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise TurboSpecError(f"tensor parallel rank {r} did not answer within {self.timeout_s:g} s")
        return buf

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n > self.max_numel:
            return super().all_reduce(x)
        buf = self._exchange(x)
        total = buf[0, :n].clone()
        for r in range(1, self.ranks):
            total += buf[r, :n]
        return total.view(x.shape).to(x.dtype)

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        if rows * max(sizes) > self.max_numel:
            return super().all_gather(x, sizes)
        buf = self._exchange(x)
        parts = [buf[r, :rows * n].view(*x.shape[:-1], n) for r, n in enumerate(sizes)]
        return torch.cat(parts, dim=-1).to(x.dtype)


    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_numel:
            return super().broadcast(x)
        return self._exchange(x)[0, :x.numel()].view(x.shape).to(x.dtype, copy=True)  # (the buffer is reused)


def collective(group=None, max_numel: int = 1 << 18) -> GlooCollective:
    """`ShmCollective` when every rank runs on this host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE), else gloo's."""
    ranks = dist.get_world_size(group)
    if group is None and int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == ranks and ranks > 1:
        return ShmCollective(group, max_numel)
    return GlooCollective(group)


# ---- the split layers --------------------------------------------------------------------------------------------
class VocabEmbedding:
    """The embedding rows of token ids [lo, hi) (this rank's): `rows(ids)` looks up the ids in the range (zeros for
    the others) and sums over the ranks, so every rank gets every id's row."""

    def __init__(self, table: torch.Tensor, lo: int, hi: int, comm: GlooCollective):
        self.table, self.lo, self.hi, self.comm = table, lo, hi, comm

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        mine = (ids >= self.lo) & (ids < self.hi)
        x = rows_of(self.table, (ids - self.lo).clamp(0, self.hi - self.lo - 1), dtype)
        return self.comm.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0))

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()


class VocabHead:
    """An LM head holding the rows of token ids [lo, hi) (this rank's): a call gives the whole vocabulary's logits,
    every rank's rows gathered in order."""

    def __init__(self, inner: Linear | LinearRows, sizes: list[int], comm: GlooCollective):
        self.inner, self.sizes, self.comm = inner, sizes, comm
        self.out_features = sum(sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(self.inner(x), self.sizes)

    def take(self, ids: torch.Tensor) -> VocabHead:
        """The head over token ids `ids` (ascending) alone: each rank keeps the ones in its range."""
        rank = dist.get_rank()
        bounds = [sum(self.sizes[:r]) for r in range(len(self.sizes) + 1)]
        counts = [int(((ids >= a) & (ids < b)).sum()) for a, b in zip(bounds, bounds[1:])]
        lo, hi = bounds[rank], bounds[rank + 1]
        mine = ids[(ids >= lo) & (ids < hi)] - lo
        return VocabHead(self.inner.take(mine), counts, self.comm)

    @property
    def takes_in_place(self) -> bool:
        return isinstance(self.inner, Linear) and self.inner.takes_in_place

    @property
    def weight(self) -> torch.Tensor:  # this rank's rows (of a whole head: a taken one reads them in place)
        assert isinstance(self.inner, Linear)
        return self.inner.weight

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def parallelize(model, group=None) -> None:
    """Make a model built from `shard_view`'s parts whole: the output projections of every mixer and
    feed-forward (the model's and its MTP module's) sum over the ranks, the embedding and LM head split by
    vocabulary."""
    ranks = dist.get_world_size(group)
    vocab = model.cfg.vocab_size
    sizes = [b - a for a, b in (vocab_range(vocab, r, ranks) for r in range(ranks))]
    comm = collective(group, max_numel=max(1 << 18, 16 * max(sizes)))  # up to 16 rows of logits in shared memory
    mtp = getattr(model, "mtp", None)
    layers = list(model.layers) + (list(mtp.layers) if mtp is not None else [])
    for layer in layers:
        mixer = layer.attn if isinstance(layer, DecoderLayer) else layer.mixer
        if isinstance(mixer, Attention):
            mixer.o = RowParallelLinear(mixer.o, comm.all_reduce)
        elif isinstance(mixer, GatedDeltaNet):
            mixer.out = RowParallelLinear(mixer.out, comm.all_reduce)
        if isinstance(layer.mlp, MLP):
            layer.mlp.down = RowParallelLinear(layer.mlp.down, comm.all_reduce)
        elif isinstance(layer.mlp, MoE):
            layer.mlp = RowParallelMoE(layer.mlp, comm.all_reduce)
    lo, hi = vocab_range(vocab, dist.get_rank(group), ranks)
    model.lm_head = VocabHead(model.lm_head, sizes, comm)
    model.embed = VocabEmbedding(model.embed, lo, hi, comm)
    if mtp is not None:
        mtp.embed, mtp.lm_head = model.embed, model.lm_head


def rank0_ints(group=None, longest: int = 1024) -> Callable[[list[int]], list[int]]:
    """A post of rank 0's decisions: every rank calls the returned function at the same point with its own list of
    at most `longest` ints (token ids, draft lengths, flags: each below 2^24, exact in the shared buffer's float32)
    and all get rank 0's list back."""
    comm = collective(group, max_numel=longest + 1)

    def post(values: list[int]) -> list[int]:
        if len(values) > longest:
            raise TurboSpecError(f"{len(values)} values to agree on in one step; at most {longest} are posted")
        mine = torch.zeros(longest + 1, dtype=torch.int64)
        mine[0] = len(values)
        mine[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        got = comm.broadcast(mine).tolist()
        return [int(v) for v in got[1:1 + int(got[0])]]

    return post


def rank0_choice(group=None, longest: int = 1024) -> Callable[[list[int], int], tuple[list[int], int]]:
    """`Engine.agree` for this rank: every rank posts its (accepted draft nodes, next token) of a step and all take
    rank 0's, so that rank 0 alone decides what is emitted (each rank's own choice comes from the same gathered
    logits with rank 0's seed, so it agrees unless the ranks' arithmetic differs, as on mixed hosts)."""
    post = rank0_ints(group, longest + 1)

    def agree(path: list[int], nxt: int) -> tuple[list[int], int]:
        if len(path) > longest:
            raise TurboSpecError(f"a verification step accepted {len(path)} drafts; at most {longest} are agreed on")
        got = post([nxt, *path])
        return got[1:], got[0]

    return agree


def load_model_tp(path: str, dtype: torch.dtype | str = "float32", weights: str = "auto",
                  moe_cache_mem: int | None = None, group=None):
    """Rank `dist.get_rank()`'s part of the checkpoint at `path` (a safetensors directory or a GGUF file),
    ready to run in step with the other ranks."""
    from turbospec.model.registry import load_model

    model = load_model(path, dtype, weights, moe_cache_mem, shard=shard_view(group))
    parallelize(model, group)
    return model


# ---- serving: rank 0 answers HTTP, the other ranks follow its engine calls ----------------------------------------
def command_group():
    """A process group for rank 0's announcements to the other ranks of a server, made by every rank at the same
    point: gloo without a practical timeout, because a server may wait for its next request for hours (the other
    collectives keep `TIMEOUT`; a rank that dies still ends the job: torchrun stops the others)."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=365))


def _flag(value: bool | None = None) -> bool:
    """Rank 0 sends `value`, every other rank receives it (one byte over the group)."""
    t = torch.tensor([1 if value else 0], dtype=torch.uint8)
    dist.broadcast(t, src=0)
    return bool(t.item())


class Lockstep:
    """Rank 0's engine for a server under torchrun: every `stream` is announced to the other ranks (`follow`),
    with rank 0's seed, and after each chunk a flag says whether the stream goes on, so that a client that leaves
    (the server closes the stream) or a cancelled prefill (`abort`) stops every rank at the same step. Everything
    else is the engine's own."""

    def __init__(self, engine):
        self.engine = engine
        self.group = command_group()

    def __getattr__(self, name: str):  # model, tokenizer, ctx, drafter, last_stats, config, ...
        return getattr(self.engine, name)

    def stream(self, prompt, params=None, chat: bool = False, abort=None, progress=None):
        from turbospec.sampling import SamplingParams

        params = seeded(params or SamplingParams())  # the followers get this seed with the call
        dist.broadcast_object_list([("stream", prompt, params, chat)], src=0, group=self.group)
        gen = self.engine.stream(prompt, params, chat=chat, abort=lambda: _flag(bool(abort and abort())),
                                 progress=progress)
        done = False
        try:
            for chunk in gen:
                yield chunk
                _flag(False)  # the consumer asked for the next chunk: go on
            done = True
        finally:
            if not done:  # closed between chunks (the client left) or failed: the followers stop here too
                gen.close()
                _flag(True)

    def new_scheduler(self, parallel: int):
        """The continuous-batching scheduler, its calls announced to the other ranks."""
        return SchedulerLockstep(self.engine.new_scheduler(parallel), self.group)

    def announce_slot(self, action: str, slot_id: int, path, save_id: str, scheduler=None) -> None:
        """A slot action for the other ranks to do on their parts (`turbospec.engine.slots.part`), with the batching
        scheduler's calls made since its last step (`SchedulerLockstep`), so that every rank acts on the same state."""
        events = scheduler.flush() if isinstance(scheduler, SchedulerLockstep) else []
        dist.broadcast_object_list([("slot", action, slot_id, None if path is None else str(path), save_id, events)],
                                   src=0, group=self.group)

    def close(self) -> None:
        """The server stopped: the followers return."""
        dist.broadcast_object_list([("stop",)], src=0, group=self.group)


def announcements(group):
    """On a rank other than 0 of a server: rank 0's announcements (`Lockstep`, `SchedulerLockstep`) on `group` (the
    `command_group`) as they come, until it stops."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0][0] == "stop":
            return
        yield box[0]


SlotPart = Callable[..., object]  # (action, slot id, path, save id, engine, scheduler, group): turbospec.engine.slots.part


def follow(engine, slot_part: SlotPart) -> None:
    """A rank other than 0 of a server: run the engine calls (and slot actions, through `slot_part`) rank 0 announces
    (`Lockstep`) until it stops."""
    group = command_group()
    for message in announcements(group):
        if message[0] == "slot":
            _, action, slot_id, path, save_id, _ = message
            slot_part(action, slot_id, path, save_id, engine, None, group)
            continue
        _, prompt, params, chat = message
        gen = engine.stream(prompt, params, chat=chat, abort=_flag)
        try:
            for _ in gen:
                if _flag():
                    gen.close()
                    break
        except Exception:  # noqa: BLE001 -- rank 0 met the same error at the same step (same input): its stop flag
            _flag()


class SchedulerLockstep:
    """Rank 0's continuous-batching scheduler (`serve -np N` under tensor parallelism): the sequences added and
    aborted since the last step are announced with each step (prompts with the sampling settings, rank 0's seed
    drawn for those without one), and every other rank (`follow_scheduler`) makes the same calls on its own
    scheduler before the same step, so every step's forward runs the same rows on every rank."""

    def __init__(self, scheduler, group):
        self.scheduler, self.group = scheduler, group
        scheduler.agree = scheduler_choice(scheduler)
        self.events: list[tuple] = []
        self.ids: dict = {}  # running sequence -> the number the followers know it by
        self.added = 0

    def __getattr__(self, name: str):  # pool, counters, slots, ...: the scheduler's own
        return getattr(self.scheduler, name)

    def add(self, tokens: list[int], params=None):
        from turbospec.sampling import SamplingParams

        params = seeded(params or SamplingParams())
        seq = self.scheduler.add(tokens, params)  # (a refused prompt raises here: nothing to announce)
        self.ids[seq] = self.added
        self.events.append(("add", self.added, tokens, params))
        self.added += 1
        return seq

    def abort(self, seq) -> None:
        self.scheduler.abort(seq)
        if seq in self.ids:
            self.events.append(("abort", self.ids[seq]))

    def flush(self) -> list[tuple]:
        """The events since the last announcement (for one that is not a step's), which then start again."""
        events, self.events = self.events, []
        return events

    def step(self):
        dist.broadcast_object_list([("step", self.flush())], src=0, group=self.group)
        outputs = self.scheduler.step()
        for out in outputs:
            if out.finished:
                self.ids.pop(out.seq, None)
        return outputs


def scheduler_choice(scheduler) -> Callable[[list[int]], list[int]]:
    """`Scheduler.agree` for this rank: a step's decisions (every sequence's accepted draft nodes and next token,
    at most 2 + n_max values each; with --spec-adaptive whether the step drafts) are rank 0's."""
    return rank0_ints(longest=scheduler.max_seqs * (2 + scheduler.n_max))


def follow_scheduler(scheduler, engine, slot_part: SlotPart) -> None:
    """A rank other than 0 of a batching server: make the scheduler calls (and slot actions, through `slot_part`)
    rank 0 announces (`SchedulerLockstep`) on `engine`'s scheduler until it stops."""
    group = command_group()  # (made in the order rank 0 makes them: its Lockstep's group, then its scheduler's post)
    scheduler.agree = scheduler_choice(scheduler)
    running: dict = {}
    for message in announcements(group):
        for event in message[-1]:  # (a step's or a slot action's: those since the last announcement)
            if event[0] == "add":
                running[event[1]] = scheduler.add(event[2], event[3])
            else:
                scheduler.abort(running[event[1]])
        if message[0] == "slot":
            slot_part(*message[1:5], engine=engine, scheduler=scheduler, group=group)
            continue
        try:
            outputs = scheduler.step()
        except Exception:  # noqa: BLE001 -- rank 0 met the same error at the same step: it aborts those sequences next
            continue
        done = {out.seq for out in outputs if out.finished}
        for key in [k for k, seq in running.items() if seq in done]:
            del running[key]
