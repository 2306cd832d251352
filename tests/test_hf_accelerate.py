"""coda_lang.hf under Accelerate's FSDP2 and the HF Trainer: docs/models.md's recipe
(examples/accelerate/fsdp2.yaml, examples/accelerate/train.py).

Accelerate's FSDP2 preparation (`fsdp2_prepare_model`) shards each decoder layer, then the embedding
and the LM head as units of their own (one unit of both when they are tied), then the root. The
patched model reads the LM head's weight in the causal LM's forward without calling the module, so
that unit is gathered there (`coda_lang.hf.units.gathered`). In one process (a world of one, gloo),
Accelerate's own wrapping function on a tiny patched Llama, tied and untied, trains 3 AdamW steps as
the unpatched model under the same wrapping (losses and parameters, float32). Then, marked slow (the
imports of two Trainer processes take half a minute on two cores): `accelerate launch` with the
example's config file (mixed precision off, the CPU) runs the example script on 2 processes: the
Trainer trains the patched and the unpatched model, tied and untied, 5 steps each under FSDP2, with
the same losses and gradient norms.

Accelerate (1.15) enables FSDP on GPU-like distributed types only: on the CPU it drops the plugin and
the Trainer uses DDP. tests/accelerate_on_cpu.py keeps the plugin there (the distributed type set to
FSDP, as on a GPU), so the Trainer's and Accelerate's FSDP2 paths run on gloo.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf import SHAPES, make, patch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LR = 3e-3


def prepare(model: Any, checkpointing: bool = False) -> Any:
    """`model` wrapped by Accelerate's FSDP2 preparation as the example config asks (decoder layers,
    then the embedding and the LM head, then the root), in this process's group; `checkpointing`:
    each decoder layer in a checkpoint wrapper first (`fsdp_activation_checkpointing: true`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
        activation_checkpointing=checkpointing,
    )
    # what fsdp2_prepare_model reads of an Accelerator
    acc = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no", is_main_process=True
    )
    if checkpointing:
        model = fsdp2_apply_ac(acc, model)
    return fsdp2_prepare_model(acc, model)


def train(model: Any, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(0, SHAPES["vocab_size"], (2, 24), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def full(model: Any) -> dict[str, Any]:
    """The state dict under Hugging Face's names, each sharded tensor gathered whole."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


@pytest.fixture
def world_of_one() -> Any:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny matrices: threads only wait on each other)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "tied, checkpointing",
    [(False, False), (True, False), (False, True)],
    ids=["untied", "tied", "checkpointed"],
)
def test_accelerates_fsdp2_wrapping_trains_as_the_unpatched_model(
    tied: bool, checkpointing: bool, world_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accelerate's FSDP2 preparation of a patched Llama (with its activation checkpointing, or
    without): the decoder layers, the LM head (with the embedding when tied) and the root are FSDP2
    units; 3 AdamW steps give the unpatched model's losses and parameters under the same wrapping."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)  # (the plugin sets it: undone after)

    ref = make("llama", tie_word_embeddings=tied, use_cache=False)  # (a cache grows in a recompute)
    runs = {}
    for name, model in (("hf", copy.deepcopy(ref)), ("coda", patch("llama", copy.deepcopy(ref)))):
        model = prepare(model, checkpointing)
        wrapped = [getattr(layer, "_checkpoint_wrapped_module", None) for layer in model.model.layers]
        assert all(w is not None for w in wrapped) == checkpointing
        assert isinstance(model.lm_head, FSDPModule) and all(
            isinstance(layer, FSDPModule) for layer in model.model.layers
        )
        runs[name] = (train(model), full(model))
    (l_hf, p_hf), (l_coda, p_coda) = runs["hf"], runs["coda"]
    assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(l_coda, l_hf, strict=True)), (l_coda, l_hf)
    assert list(p_coda) == list(p_hf)
    for k, w in p_hf.items():
        assert float((p_coda[k] - w).abs().max()) < 0.05 * LR, k  # (AdamW: within 5% of a step)


# ---------------------------------------------------------------------------------------------------
# The recipe itself: accelerate launch, the example's config and script, 2 processes


def accelerate_launch(tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`accelerate launch` with examples/accelerate/fsdp2.yaml on 2 CPU processes (no GPU visible,
    mixed precision off, the blocks emulated), running tests/accelerate_on_cpu.py then `args`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODA_EMULATE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "examples/accelerate/fsdp2.yaml",
        "--mixed_precision",
        "no",
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        "tests/accelerate_on_cpu.py",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_trainer_recipe_trains_as_the_unpatched_model(tmp_path: Path) -> None:
    """The documented recipe on 2 processes: `accelerate launch --config_file
    examples/accelerate/fsdp2.yaml examples/accelerate/train.py`; the Trainer runs FSDP2 (every decoder
    layer a unit, the LM head one), and the patched model's losses and gradient norms equal the
    unpatched model's at each of 5 steps, tied and untied."""
    models = []
    for tied in (False, True):
        cfg = transformers.LlamaConfig(
            **SHAPES,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=tied,
        )
        where = tmp_path / ("tied" if tied else "untied")
        cfg.save_pretrained(where)
        models += ["--model", str(where)]
    out = tmp_path / "runs.json"
    r = accelerate_launch(
        tmp_path,
        "examples/accelerate/train.py",
        *models,
        "--patch=none,coda",
        "--steps=5",
        "--seq=24",
        "--batch=2",
        f"--lr={LR}",
        f"--out={tmp_path / 'trainer'}",
        f"--json={out}",
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    runs = json.loads(out.read_text())
    assert [(x["tied"], x["patch"]) for x in runs] == [
        (t, p) for t in (False, True) for p in ("none", "coda")
    ]
    for run in runs:
        assert run["world"] == 2 and run["mixed_precision"] == "no"
        assert {"(root)", "model.layers.0", "model.layers.1", "lm_head"} <= set(run["units"]), run["units"]
        assert len(run["steps"]) == 5 and all("loss" in s for s in run["steps"])
    for hf, coda in (runs[0:2], runs[2:4]):
        for a, b in zip(coda["steps"], hf["steps"], strict=True):
            assert abs(a["loss"] - b["loss"]) < 1e-5 * b["loss"], (coda["steps"], hf["steps"])
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * b["grad_norm"], (coda["steps"], hf["steps"])


@pytest.mark.gpu
def test_the_trainer_recipe_on_two_gpus(tmp_path: Path) -> None:
    """The recipe as documented, on 2 GPUs (the blocks as CUDA kernels, bf16 mixed precision as the
    config file says): the patched model trains under FSDP2, every decoder layer and the LM head a
    unit, its losses finite and within bf16 noise of the unpatched model's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cfg = transformers.LlamaConfig(**SHAPES, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.save_pretrained(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODA_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "runs.json"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "examples/accelerate/fsdp2.yaml",
    ]
    cmd += ["--num_processes", "2", "--main_process_port", "0", "examples/accelerate/train.py"]
    cmd += ["--model", str(tmp_path / "m"), "--steps=5", "--seq=64", "--batch=2", f"--lr={LR}"]
    cmd += [f"--out={tmp_path / 'trainer'}", f"--json={out}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    hf, coda = json.loads(out.read_text())
    assert coda["mixed_precision"] == "bf16" and {"model.layers.0", "lm_head"} <= set(coda["units"])
    for a, b in zip(coda["steps"], hf["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 0.02 * b["loss"], (coda["steps"], hf["steps"])
