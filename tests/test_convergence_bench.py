"""benchmarks/convergence.py (the harness of the convergence runs) on the CPU: `prepare` on the first files
of this Python's standard library writes the same bytes twice, and its tokenizer decodes a validation
file's tokens back to the file's text; `train` refuses files that don't match meta.json (exit 1), an
unknown configuration (exit 2) and one that can't run here (exit 2, before any training), and trains a
tiny Llama eager and with coda from the same weights on the same batches (the same losses within bf16's
error; eager's first loss is the documented recipe's: seed -> weights, seed -> windows); the plot's
smoothing against NumPy, the learning-rate schedule, and the plot's error without matplotlib;
hf_train_step.py's usage error for an unknown configuration, and its torchao float8 refused with LoRA.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "convergence.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("convergence", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


conv = _load()
PREPARE = ["--max-files", "20", "--vocab", "400"]


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny matrices: threads only wait on each other)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if len(conv.corpus_files(Path(sysconfig.get_paths()["stdlib"]))) < 20:
        pytest.skip("this Python's standard library has no .py sources")
    out = tmp_path_factory.mktemp("corpus")
    assert conv.main(["prepare", "--out", str(out), *PREPARE]) == 0
    return out


def test_prepare_is_deterministic_and_round_trips(data: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert conv.main(["prepare", "--out", str(again), *PREPARE]) == 0
    names = sorted(p.name for p in data.iterdir())
    assert names == ["meta.json", "tokenizer.json", "train.npy", "val.npy"]
    for name in names:
        assert (data / name).read_bytes() == (again / name).read_bytes(), name

    meta = json.loads((data / "meta.json").read_text())
    train = np.load(data / "train.npy", allow_pickle=False)
    val = np.load(data / "val.npy", allow_pickle=False)
    assert train.dtype == val.dtype == np.uint16
    splits = meta["splits"]
    assert splits["train"]["files"] + splits["val"]["files"] == 20 and splits["val"]["files"] >= 1
    assert (splits["train"]["tokens"], splits["val"]["tokens"]) == (train.size, val.size)
    for p in splits["train"]["paths"] + splits["val"]["paths"]:
        assert p.endswith(".py") and not {"test", "tests", "site-packages"} & set(p.split("/")[:-1])

    tok = tokenizers.Tokenizer.from_file(str(data / "tokenizer.json"))
    eot = tok.token_to_id(conv.EOT)
    assert eot == meta["eot_id"] and tok.get_vocab_size() == meta["vocab_size"] <= 400
    assert int(max(train.max(), val.max())) < meta["vocab_size"]
    assert int((val == eot).sum()) == splits["val"]["files"] and val[-1] == eot  # one after each file
    first = val[: int(np.argmax(val == eot))].tolist()
    text = (Path(sysconfig.get_paths()["stdlib"]) / splits["val"]["paths"][0]).read_text(encoding="utf-8")
    assert len(first) < len(text) and tok.decode(first, skip_special_tokens=False) == text


def test_files_that_do_not_match_meta_json_are_refused(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    val = np.load(bad / "val.npy", allow_pickle=False)
    val[0] = (int(val[0]) + 1) % 400
    np.save(bad / "val.npy", val)
    argv = ["train", "--data", str(bad), "--size", "tiny", "--device", "cpu", "--configs", "eager"]
    assert conv.main(argv + ["--steps", "1", "--seq", "16", "--batch", "1"]) == 1
    err = capsys.readouterr().err
    assert "val.npy does not match meta.json" in err and "run `prepare` again" in err
    assert "Traceback" not in err and "step 1" not in err


def test_configurations_are_checked_before_training(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--data", str(data), "--size", "tiny", "--device", "cpu", "--steps", "1"]
    with pytest.raises(SystemExit) as e:
        conv.main([*base, "--configs", "eager,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown configuration nope" in err and ", ".join(conv.CONFIGS) in err
    # a configuration that needs what is not here (a GPU; Liger Kernel and torchao where not installed)
    assert conv.main([*base, "--configs", "eager,liger,torchao-rowwise"]) == 2
    err = capsys.readouterr().err
    assert "liger needs" in err and "torchao-rowwise needs" in err and "eager:" not in err


def test_tiny_llama_trains_the_same_eager_and_with_coda(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    out = tmp_path / "run.json"
    argv = ["train", "--data", str(data), "--size", "tiny", "--device", "cpu", "--configs", "eager,coda"]
    argv += ["--steps", "3", "--seq", "32", "--batch", "2", "--eval-every", "2", "--eval-batches", "2"]
    assert conv.main([*argv, "--seed", "3", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run) == {"meta", "args", "results"} and run["args"]["steps"] == 3
    assert run["meta"]["model"]["vocab"] == json.loads((data / "meta.json").read_text())["vocab_size"]
    assert list(run["results"]) == ["eager", "coda"]
    for r in run["results"].values():
        assert len(r["losses"]) == len(r["grad_norms"]) == 3
        assert all(math.isfinite(v) for v in r["losses"] + r["grad_norms"])
        assert [s for s, _ in r["eval"]] == [0, 2, 3] and r["final_eval"] == r["eval"][-1][1]
        assert r["final_train_loss_avg"] == pytest.approx(sum(r["losses"]) / 3)
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_gib"] is None
    eager, coda = run["results"]["eager"]["losses"], run["results"]["coda"]["losses"]
    for a, b in zip(eager, coda, strict=True):  # the same weights and batches
        assert abs(a - b) <= 2e-2 * abs(a), (eager, coda)
    e0, c0 = run["results"]["eager"]["eval"][0][1], run["results"]["coda"]["eval"][0][1]
    assert abs(e0 - c0) <= 2e-2 * abs(e0)
    table = capsys.readouterr().out
    assert "| eager | " in table and "| coda | " in table and "vs eager" in table

    # eager's first loss is that of the documented recipe: the model from torch.manual_seed(seed), the
    # windows of train.npy at offsets drawn by a torch.Generator seeded by seed, labels = inputs
    from transformers import AutoModelForCausalLM

    tokens = torch.from_numpy(np.load(data / "train.npy").astype(np.int64))
    g = torch.Generator().manual_seed(3)
    offsets = torch.randint(0, tokens.numel() - 32 + 1, (3, 2), generator=g)[0]
    x = torch.stack([tokens[o : o + 32] for o in offsets.tolist()])
    torch.manual_seed(3)
    vocab = run["meta"]["model"]["vocab"]
    model = AutoModelForCausalLM.from_config(conv.llama_config("tiny", vocab, 32)).to(torch.bfloat16)
    with torch.no_grad():
        assert model(input_ids=x, labels=x).loss.item() == pytest.approx(eager[0], rel=1e-4)


def test_smoothing_and_the_schedule() -> None:
    assert conv.smooth([1.0, 2.0, 3.0, 4.0, 5.0], 2).tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]
    v = np.random.default_rng(0).normal(size=50)
    want = [v[max(0, i - 19) : i + 1].mean() for i in range(50)]
    np.testing.assert_allclose(conv.smooth(v, 20), want, rtol=1e-12, atol=1e-12)
    f = [conv.lr_factor(i, 10, 100) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[-1] == pytest.approx(0.1)
    assert f[:10] == sorted(f[:10]) and f[9:] == sorted(f[9:], reverse=True)


def test_plot_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib fails)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {}, "args": {}, "results": {}}))
    assert conv.main(["plot", str(run), "--out", str(tmp_path / "curves.svg")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "curves.svg").exists()


def test_hf_train_step_refuses_an_unknown_configuration_first(capsys: Any) -> None:
    """benchmarks/hf_train_step.py (whose configurations convergence.py reuses): an unknown name is a
    usage error (exit 2) naming the configurations, torchao's among them, before it looks for a GPU;
    torchao's float8 with --lora is refused before the model is touched."""
    step = conv.hf_train_step
    with pytest.raises(SystemExit) as ei:
        step.main(["--configs", "coda,bogus"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "unknown configuration 'bogus'" in err and "torchao-tensorwise" in err and "torchao-rowwise" in err
    with pytest.raises(SystemExit, match="LoRA"):
        step.prepare(None, "torchao-rowwise", lora=16)
    # Liger before another configuration would patch that one's classes too: a usage error
    with pytest.raises(SystemExit) as ei:
        step.main(["--configs", "coda,liger,torchao-tensorwise"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "list liger last" in err and "torchao-tensorwise" in err
    # a configuration captured in a CUDA graph is NAME+graph: another suffix is unknown, and so is it
    # with --lora; the liger rule reads the names without it
    for argv, said in (
        (["--configs", "coda+grap"], "each optionally with +graph"),
        (["--configs", "coda-fp8+graph", "--lora", "8"], "+graph with --lora"),
        (["--configs", "liger+graph,coda"], "list liger last"),
    ):
        with pytest.raises(SystemExit) as ei:
            step.main(argv)
        assert ei.value.code == 2, argv
        assert said in capsys.readouterr().err, argv


def test_a_configuration_patched_under_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each configuration that hf_train_step patches under variables of its own (`CONFIG_ENV`:
    coda-fp8-bf16out's $CODA_FP8_OUT=0, coda-fp8-save16's $CODA_FP8_SAVE_ACC=0) and that the convergence
    runs take is prepared with them set, and leaves the environment as it was."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    from coda_lang.hf import unpatch

    monkeypatch.delenv("CODA_FP8_OUT", raising=False)
    monkeypatch.delenv("CODA_FP8_SAVE_ACC", raising=False)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    checks = {
        "coda-fp8-bf16out": lambda st: not st.fp8_out,
        "coda-fp8-save16": lambda st: not st.fp8_save,
        "coda-fp8": lambda st: st.fp8_out and st.fp8_save,  # (the defaults)
    }
    for name, check in checks.items():
        assert name in conv.CONFIGS and (name == "coda-fp8" or name in conv.hf_train_step.CONFIG_ENV), name
        model = conv.CONFIGS[name].prepare(LlamaForCausalLM(cfg))
        assert check(model._coda), name
        assert "CODA_FP8_OUT" not in os.environ and "CODA_FP8_SAVE_ACC" not in os.environ
        unpatch(model)
