import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from turbospec.demo import make_demo_model
from turbospec.errors import TurboSpecError
from turbospec.model import load_model

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 300}


@pytest.fixture()
def tiny(tmp_path):
    return make_demo_model(tmp_path / "m", **TINY)


def run_cli(*args):
    r = subprocess.run([sys.executable, "-m", "turbospec.cli", *args], capture_output=True, text=True, timeout=120,
                       check=False)
    return r.returncode, r.stdout, r.stderr


def assert_one_line_error(rc, err, needle):
    assert rc != 0
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_sharded_equals_single(tiny, tmp_path):
    w = load_file(tiny / "model.safetensors")
    names = sorted(w)
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    (sharded / "model.safetensors").unlink()
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: w[k] for k in keys}, str(sharded / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.arange(20) % 300
    from turbospec.kv.plan import AttentionPlan

    outs = []
    for path in (tiny, sharded):
        m = load_model(path, "float32")
        c = m.new_cache(32)
        outs.append(m.logits(m.forward(ids, AttentionPlan.causal(0, 20), c)))
    assert torch.equal(outs[0], outs[1])


def test_unknown_architecture(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["model_type"] = "gpt_neo_x_42"
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TurboSpecError, match="unknown architecture 'gpt_neo_x_42'"):
        load_model(tiny)
    rc, _, err = run_cli("run", "-m", str(tiny), "-n", "2")
    assert_one_line_error(rc, err, "unknown architecture")


def test_missing_tensor(tiny):
    w = load_file(tiny / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(tiny / "model.safetensors"))
    rc, _, err = run_cli("run", "-m", str(tiny), "-n", "2")
    assert_one_line_error(rc, err, "missing tensor 'model.layers.1.mlp.up_proj.weight'")


def test_shape_mismatch(tiny):
    w = load_file(tiny / "model.safetensors")
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)
    save_file(w, str(tiny / "model.safetensors"))
    rc, _, err = run_cli("run", "-m", str(tiny), "-n", "2")
    assert_one_line_error(rc, err, "shape mismatch for 'model.layers.0.self_attn.k_proj.weight'")


def test_truncated_file(tiny):
    f = tiny / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    rc, _, err = run_cli("run", "-m", str(tiny), "-n", "2")
    assert_one_line_error(rc, err, "model.safetensors")


def test_garbage_config(tiny):
    (tiny / "config.json").write_text("{not json")
    rc, _, err = run_cli("run", "-m", str(tiny), "-n", "2")
    assert_one_line_error(rc, err, "not valid JSON")


def test_cli_run_stats_line(tiny):
    rc, out, err = run_cli("run", "-m", str(tiny), "-p", "hello", "-n", "8", "--temp", "0", "--ignore-eos")
    assert rc == 0, err
    assert out.startswith("hello")
    line = err.strip().splitlines()[-1]
    for key in ("prompt 5 tok", "prefill", "ttft", "gen 8 tok", "decode", "peak mem"):
        assert key in line, line


def test_cli_bad_sampling_flag(tiny):
    rc, _, err = run_cli("run", "-m", str(tiny), "--top-p", "0")
    assert_one_line_error(rc, err, "top_p")
