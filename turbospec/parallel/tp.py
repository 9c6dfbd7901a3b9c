"""Tensor parallelism over `torch.distributed` (gloo on CPU), Megatron's layout as vLLM uses it: each rank holds
1/N of every decoder layer's attention heads (their q/k/v rows, their KV cache) and of the MLP's intermediate
columns; the output projection and the MLP's down projection multiply the rank's part and an all-reduce sums the
parts. Embedding, final norm and LM head stay whole on every rank, so every rank computes the same logits and
picks the same greedy token.

This slice covers dense models (qwen3, qwen2, llama) with float weights from safetensors, every KV format (a
rank's cache holds its heads), and the model's MTP layer (sharded the same way). Launch with `torchrun` (one
process per rank: WORLD_SIZE ranks). What is not here yet is listed in docs/parallel.md.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from turbospec.errors import TurboSpecError
from turbospec.model.config import DENSE_ARCHS, MOE_ARCHS, ModelConfig

# HF tensor name suffix -> the dimension a rank takes its part of (0: output rows, 1: input columns)
COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
                   "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias")
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
TIMEOUT = timedelta(seconds=120)  # a rank that dies ends the others' collectives with an error, not a hang


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
    """The config one rank builds: 1/`ranks` of the attention heads, KV heads and MLP width (one clear error when
    the model does not divide, or is not a dense architecture this slice covers)."""
    if cfg.arch not in DENSE_ARCHS or cfg.arch in MOE_ARCHS:
        dense = [a for a in DENSE_ARCHS if a not in MOE_ARCHS]
        raise TurboSpecError(f"tensor parallelism covers dense models ({', '.join(dense)}) for now; "
                             f"{cfg.arch} is not one")
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % ranks:
            raise TurboSpecError(f"tensor parallel size {ranks} does not divide {name} ({value})")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // ranks, num_kv_heads=cfg.num_kv_heads // ranks,
                               intermediate_size=cfg.intermediate_size // ranks)


class ShardedSource:
    """A `TensorSource` giving rank `rank` of `ranks` its part of the sharded tensors (`COLUMN_PARALLEL` rows,
    `ROW_PARALLEL` columns) and the others whole. The loaders ask for the local shapes; the part is read from the
    file alone (`WeightSource.shard`: a safetensors slice), so a rank reads about 1/N of the layers' bytes."""

    def __init__(self, source, rank: int, ranks: int):
        self.source, self.rank, self.ranks = source, rank, ranks

    def __getattr__(self, name: str):  # names, has, value_tiling, ...: the source's own
        return getattr(self.source, name)

    def _dim(self, name: str) -> int | None:
        if name.endswith(COLUMN_PARALLEL):
            return 0
        if name.endswith(ROW_PARALLEL):
            return 1
        return None

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        dim = self._dim(name)
        if dim is None:
            return self.source.get(name, dtype, shape)
        if shape is None or dtype is None:
            raise TurboSpecError(f"{name}: a sharded tensor is read with its dtype and local shape")
        full = tuple(s * self.ranks if i == dim else s for i, s in enumerate(shape))
        return self.source.shard(name, dim, self.rank, self.ranks, dtype, full)  # only this rank's bytes

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        return self.get(name, dtype, shape)


class ShmAllReduce:
    """All-reduce for ranks on one host through a shared-memory file: each rank copies its part into its slot, posts
    the call's number, waits (spinning) for the others' and sums every slot in rank order, so all ranks get the
    same bits. Two buffers alternate, so a rank may start the next call while another still reads this one.
    About 0.57 ms per call with gloo over loopback on this 2-core machine (two per decoder layer and token) against
    tens of microseconds here. Larger tensors than the buffer (long prefill chunks) go through gloo."""

    def __init__(self, group=None, max_numel: int = 1 << 18, timeout_s: float = TIMEOUT.total_seconds()):
        import secrets
        import tempfile

        self.group, self.max_numel, self.timeout_s = group, max_numel, timeout_s
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (a new tensor, in x's dtype)."""
        import time

        n = x.numel()
        if n > self.max_numel:
            y = x.clone()
            dist.all_reduce(y, group=self.group)
            return y
        self.calls += 1
        buf = self.data[self.calls % 2]
        buf[self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank] = self.calls
        deadline = None
        for r in range(self.ranks):
            while int(self.flags[r]) < self.calls:
                os.sched_yield()  # ranks may outnumber cores
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise TurboSpecError(f"tensor parallel rank {r} did not answer within {self.timeout_s:g} s")
        total = buf[0, :n].clone()
        for r in range(1, self.ranks):
            total += buf[r, :n]
        return total.view(x.shape).to(x.dtype)


def reducer(group=None):
    """`ShmAllReduce` when every rank runs on this host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE), else gloo's."""
    ranks = dist.get_world_size(group)
    if group is None and int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == ranks and ranks > 1:
        return ShmAllReduce(group)

    def gloo(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return gloo


class RowParallel:
    """A linear layer holding this rank's input columns: its product is a partial sum, all-reduced over the
    group (the bias, if any, added once after). Not a `Linear`, so decoder layers take their op-by-op path."""

    def __init__(self, inner, reduce):
        self.inner, self.reduce = inner, reduce
        self.bias = inner.bias
        inner.bias = None

    def __getattr__(self, name: str):  # in_features, nbytes, weight, ...
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


def parallelize(model, group=None) -> None:
    """Wrap every decoder layer's output and down projections (the model's and its MTP module's) in
    `RowParallel`."""
    layers = list(model.layers)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        layers += list(mtp.layers)
    reduce = reducer(group)
    for layer in layers:
        layer.attn.o = RowParallel(layer.attn.o, reduce)
        layer.mlp.down = RowParallel(layer.mlp.down, reduce)


def load_model_tp(path: str, dtype: torch.dtype | str = "float32", group=None):
    """Rank `dist.get_rank()`'s part of the dense checkpoint at `path` (a directory of safetensors)."""
    from turbospec.dtypes import parse_dtype
    from turbospec.model.loader import WeightSource, load_config
    from turbospec.model.registry import build_model

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    cfg = load_config(path)
    model = build_model(shard_config(cfg, ranks), ShardedSource(WeightSource(path), rank, ranks), parse_dtype(dtype))
    parallelize(model, group)
    return model


# ---- serving: rank 0 answers HTTP, the other ranks follow its engine calls ----------------------------------------
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

    def __getattr__(self, name: str):  # model, tokenizer, ctx, drafter, last_stats, config, ...
        return getattr(self.engine, name)

    def stream(self, prompt, params=None, chat: bool = False, abort=None, progress=None):
        from turbospec.sampling import SamplingParams

        params = seeded(params or SamplingParams())  # the followers get this seed with the call
        dist.broadcast_object_list([("stream", prompt, params, chat)], src=0)
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

    def close(self) -> None:
        """The server stopped: the followers return."""
        dist.broadcast_object_list([("stop",)], src=0)


def follow(engine) -> None:
    """A rank other than 0 of a server: run the engine calls rank 0 announces (`Lockstep`) until it stops."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == "stop":
            return
        _, prompt, params, chat = command
        gen = engine.stream(prompt, params, chat=chat, abort=_flag)
        try:
            for _ in gen:
                if _flag():
                    gen.close()
                    break
        except Exception:  # noqa: BLE001 -- rank 0 met the same error at the same step (same input): its stop flag
            _flag()
