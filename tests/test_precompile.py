"""`coda precompile` (cli/precompile.py, hf/precompile.py): a model's kernels from its config alone.

Without the toolchain: the kernels made from a config (a model built on the meta device, patched)
are those of a patched model with weights, whose first training step compiles them (every GEMM
stage's emitted epilogue, Llama and Qwen3, both loss modes, two dtypes); the kernels the command
asks to build (a fake build) cover every candidate tile a training step's tuner asks for, and a
second run finds them all in the cache; usage errors, unreadable and refused configs. Marked
`toolchain` and `slow` (every first tile compiled to PTX: minutes on two cores): the real command
fills an empty cache, and a patched model with weights then compiles nothing. Marked `gpu`: after
`coda precompile --seq`, a training step in a fresh process adds nothing to the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf import FAMILIES, ON_KERNELS, OWN, SHAPES, make, patch  # noqa: E402

from coda_lang.backend_cute.build import parallel  # noqa: E402
from coda_lang.backend_cute.build.cache import Kernel  # noqa: E402
from coda_lang.backend_cute.build.config import (  # noqa: E402
    TileConfig,
    candidates_for,
    fits,
    tune_candidates_for,
)
from coda_lang.backend_cute.plan.emit import emit_stage, source_hash  # noqa: E402
from coda_lang.cli import main  # noqa: E402
from coda_lang.hf import precompile as hfp  # noqa: E402
from coda_lang.hf.family import FAMILIES as KNOWN  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def write_config(where: Path, family: str = "llama", **over: Any) -> Path:
    """A tiny config of test_hf.py's shapes and the family's own settings (Qwen3: with a head_dim the
    kernels take) saved at `where`."""
    kw = {**SHAPES, **OWN.get(family, {}), **ON_KERNELS.get(family, {}), **over}
    if family == "llama":
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    FAMILIES[family][0](**kw).save_pretrained(where)
    return where


def stage_sources(blocks: list[Any]) -> set[str]:
    """The emitted epilogue of every GEMM stage of these CUDA blocks (hashed): what the cache keys."""
    return {source_hash(emit_stage(cb.specs[k - 1])) for cb in blocks for k in cb.gemm_stages}


def training_blocks(family: str, dtype: Any, loss_mode: str, fp8: str | None = None) -> list[Any]:
    """The CUDA blocks whose kernels a patched model with weights compiles at its first training step
    (its blocks at `dtype`, or of the fp8 recipe `fp8`, and its loss head, compiled together)."""
    extra = {"fp8": fp8} if fp8 else {}
    model = patch(family, make(family, **ON_KERNELS.get(family, {})), loss_mode=loss_mode, **extra)
    st = model._coda
    b = st.blocks(dtype)
    head = b.loss_head(loss_mode)
    return [cb for f in (b.first, b.layer, b.last, head) for cb in f.kernel_blocks()]


@pytest.mark.parametrize(
    "family, loss_mode, dtype, fp8",
    [
        ("llama", "rows", "bf16", None),
        ("llama", "vocab", "f16", None),
        ("qwen3", "rows", "bf16", None),
        ("olmo2", "rows", "bf16", None),  # (row stages, post norms)
        ("llama", "rows", "bf16", "delayed"),  # (`coda precompile --fp8`: fp8 GEMMs, e5m2 cotangents)
        pytest.param("qwen3", "rows", "bf16", "delayed-forward", marks=pytest.mark.slow),
        pytest.param("olmo2", "rows", "bf16", "delayed", marks=pytest.mark.slow),
        pytest.param("llama", "fp8", "bf16", "delayed", marks=pytest.mark.slow),  # (the fp8 loss head)
        # the other families' programs are Llama's with a term or two: -m slow
        *(
            pytest.param(f, "rows", "bf16", None, marks=pytest.mark.slow)
            for f in ("granite", "mistral", "ministral", "phi3", "qwen2")
        ),
    ],
)
def test_the_kernels_of_a_config_are_a_training_models(
    family: str, loss_mode: str, dtype: str, fp8: str | None, tmp_path: Path
) -> None:
    """The kernels made from the config alone (meta device, no weights) are the ones a patched model
    with weights compiles for its first training step: the same emitted epilogue for every GEMM stage,
    so every cache key is the same. With `fp8`, those of a model patched with that recipe, which
    differ from the bf16 model's."""
    cfg = hfp.read_config(write_config(tmp_path / "m", family))
    blocks = hfp.model_kernels(hfp.model_functions(cfg, hfp.DTYPES[dtype], loss_mode, fp8=fp8))
    want = training_blocks(family, hfp.DTYPES[dtype], loss_mode, fp8)
    assert stage_sources(blocks) == stage_sources(want)
    assert sorted(cb.name for cb in blocks) == sorted(cb.name for cb in want)
    if fp8:  # (not the bf16 model's kernels under another name)
        plain_mode = "rows" if loss_mode == "fp8" else loss_mode  # (the fp8 head takes fp8 layers)
        plain = hfp.model_kernels(hfp.model_functions(cfg, hfp.DTYPES[dtype], plain_mode))
        assert not stage_sources(blocks) <= stage_sources(plain)


def test_the_blockwise_kernels_of_a_config_are_a_training_models(tmp_path: Path, capsys: Any) -> None:
    """`--fp8 blockwise` at widths of whole 128s: the kernels made from the config alone are those a
    patched blockwise model with weights compiles (its block-scaled GEMMs among them); at a width that
    is not (the tiny config's hidden size 64), the CLI's one line names it, exit 1."""
    wide = dict(
        hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    cfg = hfp.read_config(write_config(tmp_path / "m", "llama", **wide))
    blocks = hfp.model_kernels(hfp.model_functions(cfg, hfp.DTYPES["bf16"], "rows", fp8="blockwise"))
    model = patch("llama", make("llama", **wide), loss_mode="rows", fp8="blockwise")
    b = model._coda.blocks(hfp.DTYPES["bf16"])
    want = [cb for f in (b.first, b.layer, b.last, b.loss_head("rows")) for cb in f.kernel_blocks()]
    assert stage_sources(blocks) == stage_sources(want)
    assert any(cb.specs[k - 1].gemm.scaled for cb in blocks for k in cb.gemm_stages)
    assert (
        main(["precompile", "--model", str(write_config(tmp_path / "t", "llama")), "--fp8", "blockwise"]) == 1
    )
    err = capsys.readouterr().err
    assert "hidden_size is 64, not a multiple of 128" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "family, targets",
    [
        ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("qwen3", ("q_proj", "v_proj")),  # (peft's default targets; the q/k norm then in a row stage)
    ],
)
def test_the_lora_kernels_of_a_config_are_a_lora_training_models(
    family: str, targets: tuple[str, ...], tmp_path: Path
) -> None:
    """With `lora` (`coda precompile --lora`): the kernels made from the config alone are those a
    patched peft LoRA model with weights (its base frozen) runs in a training step: its blocks cut
    before the adapted GEMMs, no weight differentiated."""
    peft = pytest.importorskip("peft")
    dtype = torch.bfloat16
    cfg = hfp.read_config(write_config(tmp_path / "m", family))
    got = hfp.model_kernels(hfp.model_functions(cfg, dtype, "rows", targets))
    model = make(family, **ON_KERNELS.get(family, {})).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(targets)))
    patch(family, model)
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    st = model.get_base_model()._coda
    b = st.blocks(dtype)
    made = [f for parts in b._parts.values() for f, _ in parts]
    want = [cb for f in (*made, b.row_head()) for cb in f.kernel_blocks()]
    assert stage_sources(got) == stage_sources(want)
    assert sorted(cb.name for cb in got) == sorted(cb.name for cb in want)
    with pytest.raises(ValueError, match=r"LoRA targets \['lm_head'\]"):
        hfp.model_functions(cfg, dtype, "rows", ("lm_head",))


def test_the_kernels_do_not_depend_on_the_sizes(tmp_path: Path) -> None:
    """A wider, deeper Llama with another vocabulary and head_dim has the same kernels; Qwen3's q/k
    norm makes its head_dim part of the program, and the dtype is part of every kernel."""

    def sources(path: Path, dtype: str = "bf16") -> set[str]:
        cfg = hfp.read_config(path)
        return stage_sources(hfp.model_kernels(hfp.model_functions(cfg, hfp.DTYPES[dtype])))

    base = sources(write_config(tmp_path / "a"))
    big = write_config(
        tmp_path / "b",
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=5,
        vocab_size=200,
        head_dim=32,
    )
    assert sources(big) == base != sources(big, "f16")
    q32 = sources(write_config(tmp_path / "q32", "qwen3"))
    assert q32 != sources(write_config(tmp_path / "q64", "qwen3", head_dim=64))


def test_the_timing_steps_run(tmp_path: Path) -> None:
    """`coda precompile --seq`'s two training steps of a two-layer patched model (here on the CPU, the
    kernels' stand-ins: nothing is timed) run at the given shape."""
    cfg = hfp.read_config(write_config(tmp_path / "m"))
    first, second = hfp.time_tiles(cfg, torch.bfloat16, "rows", 16, 2, device="cpu")
    assert first > 0 and second > 0


class FakeBuild:
    """Kernel statuses by cache key instead of files: `build` marks a kernel "ok" and records it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.built: list[str] = []
        fake = self
        monkeypatch.setattr(Kernel, "status", lambda k: "ok" if k.key in fake.built else None)

        def build(spec: Any, config: TileConfig, root: str, wait: bool = True) -> tuple[str, bool]:
            fake.built.append(Kernel(spec, config, Path(root)).key)
            return "ok", True

        monkeypatch.setattr(parallel, "build", build)
        from coda_lang.backend_cute.runtime import cuda_block, tiles

        monkeypatch.setattr(tiles, "find_ptxas", lambda: True)
        monkeypatch.setattr(cuda_block.CudaBlock, "runner", lambda self, k: None)


@pytest.mark.parametrize("fp8", [None, "delayed"])
def test_coda_precompile_builds_what_a_training_step_asks_for(
    fp8: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`coda precompile` (a fake build): each kernel once, among them every candidate tile the tuner
    of a training step times and each stage's first tile; a second run builds nothing. `--fp8
    delayed`: those of a model patched with fp8="delayed"."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CODA_TUNE", raising=False)
    fake = FakeBuild(monkeypatch)
    config = write_config(tmp_path / "m")
    recipe = ["--fp8", fp8] if fp8 else []
    what = f"llama (bf16{', fp8 ' + fp8 if fp8 else ''}, loss mode rows)"
    assert main(["precompile", "--model", str(config), *recipe, "-j", "1", "-q"]) == 0
    out = capsys.readouterr().out
    assert len(fake.built) == len(set(fake.built)) > 0
    assert out.startswith(f"kernels of {what}: {len(fake.built)} compiled (in this process")
    for cb in training_blocks("llama", torch.bfloat16, "rows", fp8):
        for k in cb.gemm_stages:
            spec = cb.specs[k - 1]
            first = next(c for c in candidates_for(spec) if fits(spec, c))
            for c in {first, *(c for c in tune_candidates_for(spec) if fits(spec, c))}:
                assert Kernel(spec, c, tmp_path / "cache").key in fake.built, (cb.name, k, c)
    assert f"kernel cache: {tmp_path / 'cache'}" in out
    n = len(fake.built)
    assert main(["precompile", "--model", str(tmp_path / "m" / "config.json"), *recipe, "-q"]) == 0
    assert len(fake.built) == n
    assert capsys.readouterr().out.startswith(f"kernels of {what}: all {n} in the cache")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--jobs", "0"], "--jobs takes a positive number"),
        (["--seq", "x"], "--seq takes a positive number"),
        (["--seq", "8", "--batch", "0"], "--batch takes a positive number"),
        (["--batch", "2"], "--batch goes with --seq"),
        (["--lora", ","], "--lora takes target module names"),
        (["--lora", "q_proj", "--seq", "8"], "--lora goes without it"),
        (["--lora", "q_proj", "--fp8", "delayed"], "--lora goes without --fp8"),
        (["--loss-mode", "fp8"], "--loss-mode fp8 goes with --fp8 delayed"),
        (["--loss-mode", "fp8", "--fp8", "delayed-forward"], "--loss-mode fp8 goes with --fp8 delayed"),
    ],
)
def test_coda_precompile_usage_errors(args: list[str], needle: str, tmp_path: Path, capsys: Any) -> None:
    assert main(["precompile", "--model", str(write_config(tmp_path / "m")), *args]) == 2
    assert needle in capsys.readouterr().err


def test_coda_precompile_argument_errors(capsys: Any) -> None:
    for args in (
        ["precompile"],
        ["precompile", "--model", "m", "--dtype", "f64"],
        ["precompile", "--model", "m", "--fp8", "tensorwise"],
    ):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "invalid choice: 'f64'" in err and "invalid choice: 'tensorwise'" in err


def test_coda_precompile_takes_the_patchs_fp8_recipes() -> None:
    """--fp8's choices are the recipes apply_coda takes (the CLI keeps its own list so that `coda
    --help` imports no torch)."""
    from coda_lang.cli import precompile as cli
    from coda_lang.hf.blocks import FP8_RECIPES

    assert cli.FP8_RECIPES == FP8_RECIPES


def test_coda_precompile_takes_the_patchs_loss_modes() -> None:
    from coda_lang.cli import precompile as cli
    from coda_lang.hf.loss import LOSS_MODES

    assert cli.LOSS_MODES == LOSS_MODES


def test_coda_precompile_bad_configs(tmp_path: Path, capsys: Any) -> None:
    """An unreadable config is exit 2; one that is not JSON, of another family, or that the patch
    refuses is exit 1, each with one line saying why (no traceback)."""
    assert main(["precompile", "--model", str(tmp_path / "nope")]) == 2
    assert "can't read" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["precompile", "--model", str(bad)]) == 1
    assert "is not JSON" in capsys.readouterr().err
    gpt = tmp_path / "gpt2.json"
    gpt.write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["precompile", "--model", str(gpt)]) == 1
    assert "model_type 'gpt2'; coda_lang.hf patches " + ", ".join(sorted(KNOWN)) in capsys.readouterr().err
    biased = write_config(tmp_path / "b", attention_bias=True)
    assert main(["precompile", "--model", str(biased)]) == 1
    err = capsys.readouterr().err
    assert "attention_bias=True" in err and "Traceback" not in err


def test_coda_precompile_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", "precompile", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and "--model CONFIG" in r.stdout and "$CODA_CACHE_DIR" in r.stdout


# ---------------------------------------------------------------------------------------------------
# The real compiles


def coda_precompile(config: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`coda precompile --model CONFIG ARGS` in a fresh process with `env`."""
    cmd = [sys.executable, "-m", "coda_lang.cli", "precompile", "--model", str(config), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)


@pytest.mark.slow  # (every stage's first tile compiled to PTX: minutes on two cores)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fp8", [None, "delayed"])
def test_after_coda_precompile_a_training_model_compiles_nothing(fp8: str | None, tmp_path: Path) -> None:
    """With CODA_TUNE=0 (each stage's first tile without spills, nothing timed): `coda precompile`
    (`--fp8 delayed`: of the model patched with fp8="delayed") fills an empty cache; then a patched
    model with weights asks for its first step's kernels in another process, and none is compiled."""
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path / "cache"), "CODA_TUNE": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    config = write_config(tmp_path / "m")
    r = coda_precompile(config, env, *(["--fp8", fp8] if fp8 else []))
    assert r.returncode == 0, r.stderr[-3000:]
    assert " compiled (" in r.stdout and "coda: compiling" in r.stderr, (r.stdout, r.stderr[-2000:])
    check = (
        "import sys, json; sys.path.insert(0, 'tests'); import torch; from test_precompile import training_blocks;"
        "from coda_lang.backend_cute.runtime.tiles import precompile;"
        f"d = precompile(training_blocks('llama', torch.bfloat16, 'rows', {fp8!r}), jobs=1, quiet=True);"
        "print(json.dumps({'compiled': d.compiled if d else 0, 'cached': d.cached if d else 0}))"
    )
    r = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["compiled"] == 0 and got["cached"] > 0, got


@pytest.mark.gpu
def test_after_coda_precompile_with_seq_a_training_step_adds_nothing(tmp_path: Path) -> None:
    """On a Hopper GPU: `coda precompile --seq 256` (compiles and times), then one training step of a
    patched model with weights at that shape in a fresh process: no kernel file and no tile choice is
    added to the cache."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    config = write_config(tmp_path / "m", hidden_size=256, intermediate_size=512, vocab_size=1024)
    r = coda_precompile(config, env, "--seq", "256", "--batch", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiles timed at 2 x 256 tokens" in r.stdout, r.stdout

    def files() -> dict[str, int]:
        root = tmp_path / "cache"
        return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}

    before = files()
    step = (
        "import sys, torch; sys.path.insert(0, 'tests');"
        "from coda_lang.hf.precompile import read_config, time_tiles;"
        f"time_tiles(read_config({str(config)!r}), torch.bfloat16, 'rows', 256, 2)"
    )
    r = subprocess.run([sys.executable, "-c", step], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    added = {k for k in files() if k not in before and not k.endswith(".lock")}
    assert not added, sorted(added)
