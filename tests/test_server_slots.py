"""POST /slots/{id}?action=save|restore|erase: a slot's context goes to a file and comes back (into a fresh server,
one-at-a-time or batched, dense or hybrid) so that a prompt extending it resumes after it with the cold answer;
mismatched, corrupt or hostile input gets a one-line error."""

import random
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.test_server_cancel import live  # noqa: E402
from turbospec.config import EngineConfig  # noqa: E402
from turbospec.engine.engine import Engine  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402
from turbospec.sampling import SamplingParams  # noqa: E402
from turbospec.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "models"
pytestmark = pytest.mark.skipif(not (ROOT / "turbospec-tiny-hybrid" / "config.json").exists(),
                                reason="no bundled model")


def _engine(name, **cfg):
    path = ROOT / name
    return Engine(load_model(str(path), torch.float32), Tokenizer(str(path)), EngineConfig(ctx=2048, **cfg))


def _complete(base, prompt, n=12):
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                    "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _slot(base, i, action, filename=None):
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{base}/slots/{i}?action={action}", json=body, timeout=60)


@pytest.mark.parametrize("name,parallel,kv", [
    ("turbospec-tiny-hybrid", 1, None),
    ("turbospec-tiny-hybrid", 2, "q8_0"),
    ("turbospec-tiny", 2, None),
    ("turbospec-tiny", 1, "tbq4_0"),
])
def test_saved_context_restored_into_a_fresh_server_is_reused(tmp_path, name, parallel, kv):
    rnd = random.Random(3)
    first = [rnd.randrange(3, 900) for _ in range(300)]
    eng = _engine(name, cache_type_k=kv, cache_type_v=kv)
    with live(eng, parallel=parallel, slot_save_path=str(tmp_path)) as base:
        _complete(base, first)
        r = _slot(base, 0, "save", "conv.bin")
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["id_slot"] == 0 and saved["n_saved"] > 250 and saved["n_written"] > 0
        assert [p.name for p in tmp_path.iterdir()] == ["conv.bin"]  # written under a temporary name, renamed
    cold_eng = _engine(name, cache_type_k=kv, cache_type_v=kv, prefix_cache=False)
    answer = cold_eng.generate([first], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]["tokens"]
    follow = first + answer + [rnd.randrange(3, 900) for _ in range(40)]  # the next turn: context + answer + more
    with live(cold_eng) as base:
        cold = _complete(base, follow)
    fresh = _engine(name, cache_type_k=kv, cache_type_v=kv)
    with live(fresh, parallel=parallel, slot_save_path=str(tmp_path)) as base:
        r = _slot(base, 0, "restore", "conv.bin")
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == saved["n_saved"]
        warm = _complete(base, follow)
        assert warm["timings"]["cache_n"] == saved["n_saved"]  # resumed where the restored context ends
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        e = _slot(base, 0, "erase")
        assert e.status_code == 200 and e.json()["n_erased"] > 0


def test_slot_errors_are_one_line_and_lose_nothing(tmp_path):
    dense = _engine("turbospec-tiny")
    with live(dense, slot_save_path=str(tmp_path)) as base:
        assert _slot(base, 0, "save", "x.bin").status_code == 400  # nothing cached yet
        _complete(base, [5, 6, 7, 8] * 20)
        assert _slot(base, 0, "save", "dense.bin").status_code == 200
        assert _slot(base, 3, "save", "y.bin").status_code == 404  # one sequence at a time: slot 0 only
        for bad in ("../evil", ".hidden", "a/b", "", 7):
            r = _slot(base, 0, "save", bad)
            assert r.status_code == 400 and "filename" in r.json()["error"]["message"]
        assert _slot(base, 0, "bogus", "dense.bin").status_code == 400
        r = _slot(base, 0, "restore", "missing.bin")
        assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
        data = (tmp_path / "dense.bin").read_bytes()
        (tmp_path / "cut.bin").write_bytes(data[:len(data) // 2])
        r = _slot(base, 0, "restore", "cut.bin")
        assert r.status_code == 400 and "not readable" in r.json()["error"]["message"]
        assert _complete(base, [1, 2, 3])["usage"]["completion_tokens"] == 12  # still serving
    with live(_engine("turbospec-tiny", cache_type_k="q8_0", cache_type_v="q8_0"), slot_save_path=str(tmp_path)) as b:
        r = _slot(b, 0, "restore", "dense.bin")
        assert r.status_code == 400 and "-ctk/-ctv" in r.json()["error"]["message"]
    with live(_engine("turbospec-tiny-hybrid"), slot_save_path=str(tmp_path)) as b:
        r = _slot(b, 0, "restore", "dense.bin")
        assert r.status_code == 400 and "another model" in r.json()["error"]["message"]
    with live(dense) as b:  # no --slot-save-path
        assert _slot(b, 0, "save", "z.bin").status_code == 501
