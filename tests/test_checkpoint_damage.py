"""A damaged newest checkpoint, whichever of its files is damaged: the relaunch moves it aside and
resumes from the previous one by itself, with its checksums recorded or without them (an older
jaxtrain's, or a process killed between orbax's rename and their record: then a damaged state
file passed the check, the restore failed and the launch ended with exit 2, issue 32)."""

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from processes import clean_env

from jaxtrain.config import load_config
from jaxtrain.disk import checkpoint
from jaxtrain.disk.checkpoint import CHECKSUMS, Checkpointer
from jaxtrain.run import start
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

ROOT = Path(__file__).resolve().parents[1]
# A failed read leaves orbax's other reads of that restore un-awaited: noise, not what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
TINY = [
    "--config",
    "configs/tiny.yaml",
    "--eval_interval",
    "0",
    "--log_interval",
    "1",
    "--sample_tokens",
    "0",
]


def _train(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *TINY, "--run_dir", str(run_dir)],
        cwd=ROOT, env=clean_env(1), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A finished tiny run: checkpoints 10 and 20, a loss at every step."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    out = _train(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def built(reference):
    """The tiny run built in this process (8 devices), and its step-20 state as saved."""
    run = build(Job.of_devices(load_config([*TINY, "--run_dir", str(reference)]), jax.devices()))
    ckpt = Checkpointer(reference / "checkpoints", 2, read_only=True)
    whole = ckpt.restore(20, run.target)
    ckpt.close()
    return run, whole


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _garbled(p: Path) -> None:
    p.write_bytes(b"\x00garbage{{{" + p.read_bytes()[11:])


def _json_array(p: Path) -> None:
    """Valid JSON, not the object jaxtrain's own files hold (its check raised on this); orbax's
    `_CHECKPOINT_METADATA` so damaged is refused by orbax itself, before any fallback can start."""
    p.write_bytes(b"[]\n")


JAXTRAIN_JSON = (CHECKSUMS, "meta/metadata")  # the files jaxtrain's check parses itself
DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "garbled": _garbled,
    "json_array": _json_array,
    "deleted": Path.unlink,
}


def _relaunch_finds(run, ckpts: Path, whole) -> int:
    """The step a relaunch over `ckpts` resumes, found as train.py finds it; the newest one is
    restored too (as saved: it was not damaged, or not where the restore reads)."""
    ckpt = Checkpointer(ckpts, 2)
    try:
        found = start.find_start(run, ckpt)
        assert found is not None
        assert found[0].read_meta(found[1])["data_position"] == found[1]
        if found[1] == 20:
            state, _ = start.start_state(run, found)
            assert _same(state, whole), "checkpoint 20 restored with other values than it was saved with"
        return found[1]
    finally:
        ckpt.close()


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no_checksums"])
@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damaged_file_of_the_newest_checkpoint_falls_back_to_the_previous(
    damage, checksums, reference, built, tmp_path, monkeypatch
) -> None:
    """Each file orbax (and jaxtrain) writes in step dir 20, damaged in turn: the relaunch resumes
    from 10 with 20 moved aside whole, or (no checksums: nothing tells a harmless change) from 20
    exactly as saved. Never an error."""
    run, whole = built
    monkeypatch.setattr(checkpoint, "READ_BACK_BYTES", 1 << 16)  # a state read back in many parts
    names = sorted(
        str(p.relative_to(reference / "checkpoints/20"))
        for p in (reference / "checkpoints/20").rglob("*")
        if p.is_file()
    )
    assert {"_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA", "state/manifest.ocdbt"} <= set(names)
    wrong = []
    for i, name in enumerate(names):
        if (name == CHECKSUMS and not checksums) or (damage == "json_array" and name not in JAXTRAIN_JSON):
            continue
        ckpts = tmp_path / str(i) / "checkpoints"
        shutil.copytree(reference / "checkpoints", ckpts)
        if not checksums:
            for step_dir in ckpts.iterdir():
                (step_dir / CHECKSUMS).unlink()
        DAMAGES[damage](ckpts / "20" / name)
        damaged = {
            str(p.relative_to(ckpts / "20")): p.read_bytes() for p in (ckpts / "20").rglob("*") if p.is_file()
        }
        try:
            step = _relaunch_finds(run, ckpts, whole)
        except Exception as e:
            wrong.append(f"{name}: {type(e).__name__}: {e}")
            continue
        no_checksums = not checksums or (name == CHECKSUMS and damage == "deleted")
        if step == 20 and no_checksums:
            continue  # a file the restore does not need (or only checks loosely): nothing lost
        asides = list((ckpts.parent / "damaged_checkpoints").glob("20.*"))
        if step != 10 or (ckpts / "20").exists() or len(asides) != 1:
            wrong.append(f"{name}: resumed from {step}, moved aside {asides}")
            continue
        kept = {str(p.relative_to(asides[0])): p.read_bytes() for p in asides[0].rglob("*") if p.is_file()}
        if kept != damaged:
            wrong.append(f"{name}: the damaged checkpoint was changed when moved aside")
    assert not wrong, "\n".join(wrong)


def test_a_relaunch_over_a_truncated_checkpoint_without_checksums_trains_on_from_the_previous(
    reference, tmp_path
) -> None:
    """The case of issue 32 as a process meets it: the newest checkpoint's biggest state file cut
    short, no checksums recorded. The relaunch exits 0, having trained steps 11-20 again on the
    same batches (losses bitwise those of the unbroken run)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            line + "\n"
            for line in (reference / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("step", 0) <= 10
        )
    )
    ckpts = run_dir / "checkpoints"
    (ckpts / "20" / CHECKSUMS).unlink()
    biggest = max(
        (p for p in (ckpts / "20" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    _truncated(biggest)
    out = _train(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"checkpoint {ckpts}/20 is unreadable (its state is unreadable" in out.stdout
    assert f"resumed from {ckpts}/10" in out.stdout
    assert next((run_dir / "damaged_checkpoints").iterdir()).name.startswith("20.")
    assert _losses(run_dir) == _losses(reference)
