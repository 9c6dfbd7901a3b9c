"""Side by side with llama.cpp, where it is installed (never in CI): set TURBOSPEC_LLAMA_SERVER to a llama-server
binary. llama.cpp loads turbospec's exports and decodes the same greedy tokens, the hybrid with its own MTP drafting
from the exported nextn layer."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
SERVER = os.environ.get("TURBOSPEC_LLAMA_SERVER")
pytestmark = pytest.mark.skipif(not SERVER, reason="TURBOSPEC_LLAMA_SERVER (a llama-server binary) is not set")
MODELS = Path(__file__).resolve().parents[1] / "models"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("bundled", "flags"), [("turbospec-tiny", []),
                                                ("turbospec-tiny-hybrid", ["--spec-type", "draft-mtp"])])
def test_llama_cpp_runs_the_export_with_our_greedy_tokens(tmp_path, bundled, flags):
    from turbospec import EngineConfig, SamplingParams, build_engine
    from turbospec.model.gguf_export import export_gguf

    out = export_gguf(MODELS / bundled, tmp_path / "m.gguf", "f32")
    eng = build_engine(EngineConfig(model=str(MODELS / bundled)))
    ids = eng.tokenizer.encode("import os\n\n\nclass FileCache:\n    def __init__(self, path):\n")
    ours = [t for c in eng.stream(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) for t in c.tokens]
    port = _port()
    proc = subprocess.Popen([SERVER, "-m", str(out), "--port", str(port), "-c", "1024", "-np", "1", "--no-webui",
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "llama-server did not start"
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120, json={
            "prompt": ids, "n_predict": 32, "temperature": 0, "ignore_eos": True, "return_tokens": True}).json()
    finally:
        proc.terminate()
        proc.wait(30)
    assert r["tokens"] == ours
    if flags:
        assert r["timings"]["draft_n_accepted"] > 0
