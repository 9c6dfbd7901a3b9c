"""Slot save / restore / erase (`/slots/{id}?action=...`, llama-server's shape) for the one-sequence engine (slot 0:
its cache and the tokens in it) and for the continuous-batching scheduler (slots 0..N-1: the context of the last
sequence that ran in each, as the prefix cache holds it). Files: `turbospec.kv.slot_file`."""

from __future__ import annotations

import time
from pathlib import Path

from turbospec.dtypes import short_name
from turbospec.errors import TurboSpecError
from turbospec.kv import slot_file
from turbospec.kv.hybrid_cache import HybridCache
from turbospec.kv.slot_file import SlotData

ACTIONS = ("save", "restore", "erase")


def kv_formats(engine) -> tuple[str, str]:
    """The K and V format names of the engine's caches (-ctk/-ctv, default the model dtype)."""
    c, dt = engine.config, short_name(engine.model.dtype)
    return c.cache_type_k or dt, c.cache_type_v or dt


def engine_data(engine) -> SlotData:
    """The one-sequence engine's context: the tokens in its cache and their K/V (and recurrent states)."""
    cache = engine.cache
    n = cache.length
    if not n:
        raise TurboSpecError("slot 0 holds no cached context")
    kv = cache.kv if isinstance(cache, HybridCache) else cache
    k, v = kv.fields()
    data = SlotData(list(engine.cached_tokens[:n]), {f: t[:, :, :n] for f, t in k.items()},
                    {f: t[:, :, :n] for f, t in v.items()})
    if isinstance(cache, HybridCache):
        data.conv, data.ssm = cache.conv, cache.ssm
    return data


def engine_load(engine, data: SlotData) -> None:
    """Make `data` the engine's context: the next prompt that starts with its tokens resumes after them."""
    cache = engine.cache
    hybrid = isinstance(cache, HybridCache)
    kv = cache.kv if isinstance(cache, HybridCache) else cache
    k, v = kv.fields()
    slot_file.check_fields(data, k, v)
    engine.cached_tokens = []
    cache.reset()
    kv.load(data.k, data.v)
    if hybrid:
        if data.conv is None or data.ssm is None:
            raise TurboSpecError("the slot file has no recurrent states")
        cache.set_states(data.conv, data.ssm)
        cache.checkpoint()
    engine.cached_tokens = list(data.tokens)


def run(action: str, slot: int, path: Path | None, engine, scheduler=None) -> dict:
    """Do a slot action on the worker's thread (between requests or steps); llama-server's response fields. Under
    tensor parallelism (rank 0's engine a `tp.Lockstep`) every rank does it on its own part of the context, each in
    its own file (`part`)."""
    from turbospec.parallel import tp

    if tp.world()[1] > 1:  # rank 0: the other ranks do their parts too
        import secrets

        assert isinstance(engine, tp.Lockstep), "slot actions under tensor parallelism go through rank 0's Lockstep"
        save_id = secrets.token_hex(8)
        engine.announce_slot(action, slot, path, save_id, scheduler)
        out = part(action, slot, path, save_id, engine.engine, scheduler, engine.group)
        assert out is not None
        return out
    t0 = time.perf_counter()
    result, data = prepare(action, slot, path, engine, scheduler)
    return finish(action, slot, engine, scheduler, result, data, t0)


def part(action: str, slot: int, path, save_id: str, engine, scheduler, group) -> dict | None:
    """Every tensor-parallel rank's half of a slot action: rank r > 0 saves to and restores from its own file beside
    rank 0's (the name + `.tp{r}`), each file marked with its part and the save it belongs to. The ranks change their
    caches only when every rank's file was written, or read, checked and of one save; otherwise a save removes the
    files it wrote. Rank 0 gets the response or the first rank's error (a TurboSpecError naming the rank); the
    others None."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    mine = None if path is None else Path(path) if rank == 0 else Path(f"{path}.tp{rank}")
    result, data, error, mistake = None, None, None, None
    try:
        result, data = prepare(action, slot, mine, engine, scheduler, f"{rank}/{ranks}", save_id)
    except Exception as e:  # noqa: BLE001 -- every rank must reach the gather below, whatever went wrong
        error, mistake = str(e) or type(e).__name__, e
    got: list = [None] * ranks
    dist.all_gather_object(got, (error, data.save_id if data is not None else save_id), group=group)
    failed = [(r, msg) for r, (msg, _) in enumerate(got) if msg is not None]
    if not failed and len({sid for _, sid in got}) > 1:
        failed = [(0, f"the ranks' slot files of {Path(path).name!r} come from different saves")]
    if failed:
        if action == "save" and result is not None and mine is not None:
            mine.unlink(missing_ok=True)  # no set of files with one rank's part missing
        if rank != 0:
            return None
        if mistake is not None:
            raise mistake  # (rank 0's own, as a one-process server raises it)
        r, msg = failed[0]
        raise TurboSpecError(msg if r == 0 else f"rank {r}: {msg}")
    try:
        out = finish(action, slot, engine, scheduler, result or {}, data, t0)
    except Exception:
        if rank != 0:
            return None  # (the same error on every rank: the caches' states and the slot's checks are alike)
        raise
    return out if rank == 0 else None


def prepare(action: str, slot: int, path: Path | None, engine, scheduler=None, part: str = "", save_id: str = ""
            ) -> tuple[dict, SlotData | None]:
    """The half of a slot action that changes no cache: `save` writes the file (`part`, `save_id`: a tensor-parallel
    rank's, see `slot_file.save`); `restore` reads it and checks it against the cache (the data to load, for
    `finish`); `erase` checks the slot."""
    if scheduler is None and slot != 0:
        raise TurboSpecError(f"slot {slot} does not exist (one sequence at a time: slot 0; -np N for more)")
    if action == "erase":
        if scheduler is not None:
            scheduler.check_slot(slot)
        return {}, None
    assert path is not None
    kt, vt = kv_formats(engine)
    meta = {"model": slot_file.model_fingerprint(engine.model), "k_type": kt, "v_type": vt, "part": part}
    if action == "save":
        data = scheduler.slot_data(slot) if scheduler is not None else engine_data(engine)
        size = slot_file.save(path, data, save_id=save_id, **meta)
        return {"id_slot": slot, "filename": path.name, "n_saved": len(data.tokens), "n_written": size}, None
    hybrid = isinstance(engine.cache, HybridCache) if scheduler is None else scheduler.states is not None
    data = slot_file.load(path, hybrid=hybrid, **meta)
    if scheduler is not None:
        scheduler.check_slot(slot)
        slot_file.check_fields(data, scheduler.pool.k, scheduler.pool.v)
    else:
        kv = engine.cache.kv if isinstance(engine.cache, HybridCache) else engine.cache
        slot_file.check_fields(data, *kv.fields())
    return {"id_slot": slot, "filename": path.name, "n_restored": len(data.tokens), "n_read": path.stat().st_size}, data


def finish(action: str, slot: int, engine, scheduler, result: dict, data: SlotData | None, t0: float) -> dict:
    """The half of a slot action that changes the cache (`restore` loads `data`, `erase` forgets the slot's context);
    the response with its timings."""
    if action == "erase":
        if scheduler is not None:
            n = scheduler.erase_slot(slot)
        else:
            n = engine.cache.length
            engine.cache.reset()
            engine.cached_tokens = []
        return {"id_slot": slot, "n_erased": n}
    if action == "restore":
        assert data is not None
        if scheduler is not None:
            scheduler.load_slot(slot, data)
        else:
            engine_load(engine, data)
    return result | {"timings": {f"{action}_ms": (time.perf_counter() - t0) * 1e3}}
