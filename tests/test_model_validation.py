"""Malformed model files are one-line errors, never tracebacks, and never make the loader read outside the model
directory; checkpoints are never unpickled (`torch.load(weights_only=True)` everywhere)."""

import ast
import json
from pathlib import Path

import pytest

from turbospec.cli.main import main
from turbospec.demo import make_demo_model
from turbospec.errors import TurboSpecError
from turbospec.model import load_model
from turbospec.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 300}
DENSE = {"model_type": "qwen3", **TINY}
HYBRID = {"model_type": "qwen3_5_text", **TINY, "num_hidden_layers": 4, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("val") / "m", **TINY)


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) != 0
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


BAD_CONFIGS = [  # (base, changes, words the error names)
    (DENSE, {"num_attention_heads": 0}, "num_attention_heads"),
    (DENSE, {"num_attention_heads": -4}, "num_attention_heads"),
    (DENSE, {"num_attention_heads": 2.5}, "num_attention_heads"),
    (DENSE, {"vocab_size": "300"}, "vocab_size"),
    (DENSE, {"vocab_size": True}, "vocab_size"),
    (DENSE, {"hidden_size": -32}, "hidden_size"),
    (DENSE, {"intermediate_size": 64.5}, "intermediate_size"),
    (DENSE, {"num_hidden_layers": None}, "num_hidden_layers"),
    (DENSE, {"num_key_value_heads": 3}, "num_key_value_heads"),
    (DENSE, {"num_key_value_heads": 0}, "num_key_value_heads"),
    (DENSE, {"head_dim": None, "hidden_size": 30}, "hidden_size (30) is not a multiple"),
    (DENSE, {"head_dim": 0}, "head_dim"),
    (DENSE, {"head_dim": 7}, "even number"),
    (DENSE, {"max_position_embeddings": 0}, "max_position_embeddings"),
    (DENSE, {"rms_norm_eps": -1}, "rms_norm_eps"),
    (DENSE, {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    (DENSE, {"rope_theta": "big"}, "rope_theta"),
    (DENSE, {"rope_theta": 0}, "rope_theta"),
    (DENSE, {"rope_scaling": {"rope_type": "linear"}}, "'factor'"),
    (DENSE, {"rope_scaling": {"rope_type": "linear", "factor": -2}}, "factor"),
    (DENSE, {"rope_scaling": {"rope_type": ["x"]}}, "rope type"),
    (DENSE, {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    (DENSE, {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    (DENSE, {"eos_token_id": "x"}, "eos_token_id"),
    (DENSE, {"bos_token_id": -1}, "bos_token_id"),
    (DENSE, {"hidden_act": ["silu"]}, "activation"),
    (HYBRID, {"full_attention_interval": 0}, "full_attention_interval"),
    (HYBRID, {"full_attention_interval": "4"}, "full_attention_interval"),
    (HYBRID, {"layer_types": "full_attention"}, "layer_types"),
    (HYBRID, {"layer_types": ["full_attention"]}, "layer_types"),
    (HYBRID, {"linear_num_key_heads": 0}, "linear_num_key_heads"),
    (HYBRID, {"linear_num_value_heads": 3}, "linear_num_value_heads"),
    (HYBRID, {"linear_conv_kernel_dim": -1}, "linear_conv_kernel_dim"),
    ({**HYBRID, "model_type": "qwen3_next"}, {"num_experts": 4, "moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({**HYBRID, "model_type": "qwen3_next"}, {"num_experts": 4, "moe_intermediate_size": 8,
                                              "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({**HYBRID, "model_type": "qwen3_next"}, {"num_experts": 4, "moe_intermediate_size": 8,
                                              "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"model_type": "qwen3_5", "text_config": [1]}, {}, "text_config"),
    ({"model_type": ["qwen3"]}, {}, "unknown architecture"),
]


@pytest.mark.parametrize(("base", "changes", "needle"), BAD_CONFIGS,
                         ids=[f"{b['model_type']}-{c}" for b, c, _ in BAD_CONFIGS])
def test_bad_config_values_are_one_line_errors(base, changes, needle):
    with pytest.raises(TurboSpecError) as e:
        ModelConfig.from_dict({**base, **changes})
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and len(msg) < 300, msg


def test_good_configs_still_load():
    assert ModelConfig.from_dict(DENSE).head_dim == 8
    assert ModelConfig.from_dict({**DENSE, "head_dim": None, "num_key_value_heads": None}).num_kv_heads == 4
    assert ModelConfig.from_dict({**DENSE, "vocab_size": 300.0}).vocab_size == 300  # integral float
    cfg = ModelConfig.from_dict(HYBRID)
    assert cfg.layer_types() == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(TurboSpecError, match="num_attention_heads"):  # direct construction is checked too
        ModelConfig(**{**cfg.__dict__, "num_heads": 0})


@pytest.mark.parametrize("text", ["[1, 2]", '"config"', "{\"model_type\": 1" + "0" * 5000 + "}", "\xff\xfe"],
                         ids=["list", "string", "5001-digit-int", "not-utf8"])
def test_config_file_that_is_not_an_object(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(TurboSpecError):
        ModelConfig.from_file(tmp_path / "config.json")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "/abs/model.safetensors",
                                   "sub/../../x.safetensors", "model.bin", "", "C:\\x.safetensors", 7])
def test_index_entries_outside_the_directory_are_refused(tiny, tmp_path, shard, capsys):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())  # would load if read
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": shard, "model.norm.weight": "model.safetensors"}}))
    with pytest.raises(TurboSpecError, match="shards must be relative"):
        load_model(d)
    _one_line_error(capsys, ["run", "-m", str(d), "-n", "1", "-p", "x"], "shards must be relative")


def test_index_in_a_subdirectory_still_loads(tiny, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (d / "shards").mkdir()
    (d / "model.safetensors").rename(d / "shards" / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(d / "shards" / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 -- safe_open is not iterable
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "shards/model.safetensors")}))
    assert load_model(d, "float32").cfg.vocab_size == 300


@pytest.mark.parametrize("index", ['{"weight_map": [1]}', "[]", '{"nothing": {}}'])
def test_malformed_index(tiny, tmp_path, index):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(TurboSpecError):
        load_model(d)


@pytest.mark.parametrize(("changes", "needle"), [({"num_attention_heads": 0}, "num_attention_heads"),
                                                 ({"vocab_size": "300"}, "vocab_size")])
def test_cli_run_on_a_bad_model_dir_prints_one_line(tiny, tmp_path, capsys, changes, needle):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    _one_line_error(capsys, ["run", "-m", str(d), "-n", "1", "-p", "x"], needle)


def _torch_load_calls():
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "shared", "node_modules"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(rel))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                yield f"{rel}:{node.lineno}", node


def test_every_torch_load_is_weights_only():
    calls = list(_torch_load_calls())
    assert calls, "expected the training scripts' checkpoint loads"
    for where, node in calls:
        kw = {k.arg: k.value for k in node.keywords}
        assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, where
