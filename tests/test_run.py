"""The run built once (run/build.py, run/job.py) and a whole training run in this process (run/loop.py).

The real-process tests (test_train_script.py, test_launch.py, ...) run the same code behind
scripts/train.py; these run it in-process, so a failure shows its own traceback.
"""

import contextlib
import json
import math
import shutil

import jax
import pytest

from jaxtrain.cluster.detect import detect
from jaxtrain.config import DistConfig, load_config
from jaxtrain.disk import checkpoint as ckpt_lib
from jaxtrain.observe.goodput import Timeline
from jaxtrain.run.build import build
from jaxtrain.run.job import Job
from jaxtrain.run.loop import _Saver, train

TINY = ["--config", "configs/tiny.yaml", "--log_interval", "1", "--eval_interval", "2", "--eval_batches", "1"]
SINGLE = detect(DistConfig(), {})


def test_building_touches_no_device():
    cfg = load_config([*TINY, "--mesh.fsdp", "4"])
    before = len(jax.live_arrays())
    run = build(Job.of_devices(cfg, jax.devices()))
    assert len(jax.live_arrays()) == before  # shapes and shardings only
    assert run.cfg.mesh.data == 2 and run.cfg.mesh.fsdp == 4  # resolved on the 8 devices given
    dp = build(Job.of_devices(load_config(TINY), jax.devices()))
    assert run.state_bytes_per_device < dp.state_bytes_per_device / 3  # fsdp 4 splits the state
    compiled = run.compile_train()  # compiling allocates nothing either
    assert compiled.memory_analysis().temp_size_in_bytes > 0 and len(jax.live_arrays()) == before


def test_pure_tensor_parallelism_compiles():
    """data 1 x fsdp 1 x tensor 2: no batch axis to average over (a pmean over its size-1 axes once
    failed XLA's partitioner, on CPUs and GPUs alike). Both compiled steps run, and agree: a fresh
    model's loss, about ln(vocab) as its logits start near zero, is the same to the eval step."""
    cfg = load_config([*TINY, "--mesh.data", "1", "--mesh.tensor", "2"])
    run = build(Job.of_devices(cfg, jax.devices()[:2]))
    train_step, eval_step = run.compile_train(), run.compile_eval()
    assert train_step.memory_analysis().temp_size_in_bytes > 0
    state = run.init_state()
    batch = jax.random.randint(jax.random.key(0), run.batch_shape.shape, 0, 256)
    batch = jax.device_put(batch, run.batch_shape.sharding)
    evaluated = float(eval_step(state.params, batch)["loss"])
    _, metrics = train_step(state, batch)  # donates the state: evaluated first
    assert float(metrics["loss"]) == pytest.approx(evaluated, rel=1e-6)
    assert evaluated == pytest.approx(math.log(256), abs=0.05)


@pytest.mark.slow
def test_a_whole_run_in_process_then_its_resume(tmp_path, capsys):
    """Four steps through the builder and the loop; with its last checkpoint gone, a relaunch
    resumes at step 2 and trains steps 3 and 4 to the same losses, bit for bit; a third launch
    finds it complete."""
    run_dir = tmp_path / "run"
    cfg = load_config([*TINY, "--total_steps", "4", "--checkpoint_interval", "2", "--run_dir", str(run_dir)])

    def losses():
        return {
            r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "loss" in r
        }

    first = train(cfg, SINGLE)
    assert first.final_step == 4 and first.val_loss is not None
    assert ckpt_lib.Checkpointer(run_dir / "checkpoints", 3, read_only=True).all_steps() == [2, 4]
    unbroken = losses()
    shutil.rmtree(run_dir / "checkpoints" / "4")
    again = train(cfg, SINGLE)
    assert again.final_step == 4 and again.val_loss == first.val_loss
    assert losses() == unbroken  # steps 3 and 4 again, equal to the last bit
    launches = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r.get("event") == "launch"]
    assert [r["step"] for r in launches] == [0, 2]

    # Relaunched once more, after its last step: complete, nothing compiled or written.
    def files():
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}

    before = files()
    done = train(cfg, SINGLE)
    assert done.final_step == 4 and done.last_loss is None and files() == before
    assert f"{run_dir} is complete at step 4" in capsys.readouterr().out
    # A launch that resumed from its own step 4 and ends there (a stop before its first step)
    # saves nothing again: orbax refused the step it already holds (StepAlreadyExistsError).
    ckpt = ckpt_lib.Checkpointer(run_dir / "checkpoints", 3)
    saver = _Saver(None, ckpt, _NoWatchdog(), Timeline(), 4)
    saver.save_last(4, None, None)
    assert files() == before


class _NoWatchdog:
    def phase(self, what):
        return contextlib.nullcontext()


def test_eval_takes_the_train_steps_microbatches():
    """The eval step walks the global batch in the train step's microbatches: the same loss as the
    whole batch at once, and a smaller peak (evaluation fits wherever training does)."""
    flags = [*TINY, "--batch_size", "256", "--mesh.fsdp", "2"]
    whole = build(Job.of_devices(load_config(flags), jax.devices()))
    micro = build(Job.of_devices(load_config([*flags, "--gradient_accumulation_steps", "8"]), jax.devices()))
    assert micro.cfg.gradient_accumulation_steps == 8 and whole.cfg.gradient_accumulation_steps == 1
    params = whole.init_state().params
    batch = jax.random.randint(jax.random.key(0), (256, whole.cfg.model.seq_len + 1), 0, 256)
    batch = jax.device_put(batch, whole.batch_shape.sharding)
    assert float(micro.eval_step(params, batch)["loss"]) == pytest.approx(
        float(whole.eval_step(params, batch)["loss"]), rel=1e-6
    )
    temp = {
        n: r.compile_eval().memory_analysis().temp_size_in_bytes
        for n, r in (("whole", whole), ("micro", micro))
    }
    assert temp["micro"] < temp["whole"] / 2, temp
