"""Training checkpoints hold only tensors and plain Python values, so resuming loads them with
`torch.load(weights_only=True)` (a checkpoint file cannot run code)."""

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

CODE = "def add(a, b):\n    return a + b\n\n\nclass P:\n    def norm(self):\n        return self.x ** 2\n"
PROSE = "Lists\n=====\n\nLists are mutable sequences, typically used to store collections of items.\n"


def test_train_resumes_from_a_weights_only_checkpoint(tmp_path, capsys):
    from training.train import main

    code, docs = tmp_path / "code", tmp_path / "docs"
    for i in range(24):
        d = code / f"pkg{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(CODE.replace("add", f"add{i}") * 3)
    docs.mkdir()
    for i in range(12):
        (docs / f"page{i}.rst.txt").write_text(PROSE * 4 + f"\nPage {i}.\n")
    run = tmp_path / "run"
    args = ["--run", str(run), "--code-dir", str(code), "--docs-dir", str(docs), "--vocab", "400",
            "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--intermediate", "64", "--linear-heads", "2", "--linear-head-dim", "16", "--time-budget-min", "0",
            "--warmup-steps", "1", "--curriculum", "[[0, 32, 1]]", "--no-progress", "--threads", "1"]
    torch.manual_seed(0)
    _, meta = main(args + ["--max-steps", "1"])
    assert meta["step"] == 1
    ck = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=True)  # raises on pickled objects
    assert ck["meta"]["step"] == 1 and isinstance(ck["meta"]["args"], dict)
    capsys.readouterr()
    _, meta = main(args + ["--max-steps", "2"])
    assert "resumed from" in capsys.readouterr().out
    assert meta["step"] == 2 and meta["done"]
