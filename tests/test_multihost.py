"""scripts/launch_multi_node.sh across two real "hosts": network namespaces joined by a veth pair.

pytest -m multihost tests/test_multihost.py       # root; about 35 s
Its supervision alone (jaxtrain/launch/supervise.py), both "hosts" this machine, runs anywhere.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import clean_env, processes_marked, rank_pid, reaped, wait_for_training

REPO = Path(__file__).resolve().parent.parent
LAUNCH = ["bash", "scripts/launch_multi_node.sh"]
FAKE_HOSTS = REPO / "scripts/dev/fake_hosts.sh"
TINY = ["--config", "configs/tiny.yaml", "--total_steps", "10", "--eval_interval", "0"]


def _netns_works() -> str | None:
    """Why namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs the `ip` command (iproute2)"
    probe = f"jtprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe])
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> tuple[list[str], Path]:
    """Two fake hosts on an unusual private subnet; the hostfile listing them. Removed afterwards."""
    why = _netns_works()
    if why:
        pytest.skip(why)
    prefix, net = f"jt{os.getpid() % 10000}h", f"10.213.{os.getpid() % 200 + 20}"
    try:
        up = subprocess.run([FAKE_HOSTS, "up", prefix, net], capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        addresses = up.stdout.split()
        hostfile = tmp_path_factory.mktemp("hosts") / "hostfile"
        hostfile.write_text("# two fake hosts\n" + "\n".join(addresses) + "\n")
        yield addresses, hostfile
    finally:
        subprocess.run([FAKE_HOSTS, "down", prefix], timeout=60)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert prefix not in left, f"namespaces left behind: {left}"
        assert not any(Path("/etc/netns").glob(f"{prefix}*"))


def marked_env(hostfile: Path, marker: str) -> dict[str, str]:
    """Both fake hosts through the hostfile; every process, near and far, carries `marker`."""
    return clean_env(
        HOSTFILE=str(hostfile),
        JAXTRAIN_RSH=f"{FAKE_HOSTS} rsh",
        JAXTRAIN_TEST_MARK=marker,
        JAXTRAIN_FORWARD_ENV="JAXTRAIN_TEST_MARK",  # so the far side's processes carry it too
    )


@pytest.mark.multihost
@pytest.mark.slow
def test_two_hosts_train_together(hosts, tmp_path):
    (host0, host1), hostfile = hosts
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [*LAUNCH, host0, "2", "0", "--", *TINY, "--run_dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env=clean_env(HOSTFILE=str(hostfile), JAXTRAIN_RSH=f"{FAKE_HOSTS} rsh"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"distributed: source=jax_env process 0/2 local_devices=all coordinator={host0}:29500" in done.stdout
    )
    assert f"[node 1] jaxtrain launch: ranks 1..1 of 2, coordinator {host0}:29500" in done.stderr
    assert "all 2 node(s) finished" in done.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records if "event" in r][:2] == ["launch", "start"]  # goodput's events
    rows = [r for r in records if "loss" in r]
    assert [r["step"] for r in rows] == [5, 10] and rows[1]["loss"] < rows[0]["loss"]


@pytest.mark.multihost
@pytest.mark.slow
def test_killing_a_worker_on_one_host_stops_every_host(hosts, tmp_path):
    (host0, _), hostfile = hosts
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    env = marked_env(hostfile, marker)
    args = [*TINY, "--total_steps", "100000", "--log_interval", "1", "--run_dir", str(run_dir)]
    launcher = subprocess.Popen(
        [*LAUNCH, host0, "2", "0", "--", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with reaped(launcher, marker):
        wait_for_training(run_dir, launcher)
        worker = rank_pid(marker, 1)
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        _, err = launcher.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    assert launcher.returncode == 128 + signal.SIGKILL
    assert f"error: node 1 ({hosts[0][1]}) exited with code 137" in err.decode()  # named first
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"


@pytest.mark.multihost
@pytest.mark.slow
def test_preemption_on_one_host_stops_both_at_one_step_and_exits_75(hosts, tmp_path):
    (host0, _), hostfile = hosts
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    env = marked_env(hostfile, marker)
    args = [*TINY, "--total_steps", "100000", "--checkpoint_interval", "100000", "--log_interval", "1"]
    args += ["--preemption_check_interval", "2", "--run_dir", str(run_dir)]
    launcher = subprocess.Popen(
        [*LAUNCH, host0, "2", "0", "--", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(launcher, marker):
        wait_for_training(run_dir, launcher)
        os.kill(rank_pid(marker, 1), signal.SIGUSR1)  # as SLURM or a cloud would tell one host
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, err[-3000:]
    said0 = re.findall(r"^\S+ WARNING stop signal \(on another process\): saving step (\d+)$", out, re.M)
    said1 = re.findall(r"^\[node 1\] \S+ WARNING stop signal \(SIGUSR1\): saving step (\d+)$", err, re.M)
    assert len(said0) == 1 and said0 == said1, (said0, said1, err[-3000:])
    step = int(said0[0])
    assert (run_dir / "checkpoints" / str(step)).is_dir()
    both = r"^jaxtrain launch: node \d \(\S+\) exited with code 75 .*; node \d \(\S+\) exited with code 75$"
    assert re.search(both, err, re.M), err[-3000:]
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"


def _losses(run_dir: Path) -> dict[int, float]:
    if not (run_dir / "metrics.jsonl").exists():
        return {}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.multihost
@pytest.mark.slow
def test_kill_9_of_the_launching_script_ends_every_host_and_the_same_command_resumes(hosts, tmp_path):
    (host0, _), hostfile = hosts
    marker, run_dir = uuid.uuid4().hex, tmp_path / "run"
    args = [*TINY, "--total_steps", "150", "--log_interval", "1", "--checkpoint_interval", "20"]
    command = [*LAUNCH, host0, "2", "0", "--", *args, "--run_dir", str(run_dir)]
    said = tmp_path / "first.txt"  # a file, not a pipe: nobody reads it while the job trains
    with open(said, "w") as out:
        launcher = subprocess.Popen(
            command, cwd=REPO, env=marked_env(hostfile, marker), stdout=out, stderr=out
        )
    with reaped(launcher, marker):
        deadline = time.monotonic() + 120
        while (
            max(_losses(run_dir), default=0) < 23 or not (run_dir / "checkpoints/20/checksums.json").exists()
        ):
            assert launcher.poll() is None, said.read_text()[-3000:]
            assert time.monotonic() < deadline, "never got past the checkpoint of step 20"
            time.sleep(0.1)
        before = _losses(run_dir)  # steps past the checkpoint, to be computed again after the resume
        assert max(before) < 150, "the run ended before the kill"
        t0 = time.monotonic()
        os.kill(launcher.pid, signal.SIGKILL)  # the script's pid: it execs the supervising python
        again = subprocess.Popen(
            command, cwd=REPO, env=marked_env(hostfile, uuid.uuid4().hex), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while processes_marked(marker) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        outlived_s = time.monotonic() - t0
        assert processes_marked(marker) == [], f"processes left {outlived_s:.0f} s after the kill"
        # The workers train on until they see their launcher gone (a second or two: at 40 once in
        # CI, checkpoint 40 written): the killed run ends at its last logged step, not at `before`.
        killed_last = max(_losses(run_dir))
        out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err[-3000:]
    resumed = re.findall(rf"resumed from {run_dir}/checkpoints/(\d+)$", out, re.M)
    assert len(resumed) == 1 and 20 <= int(resumed[0]) <= killed_last, (resumed, killed_last)
    after = _losses(run_dir)
    assert sorted(after) == list(range(1, 151))  # every step once
    assert {s: after[s] for s in before} == before  # as the killed run had them, bit for bit (same hosts)
    print(f"kill -9 of launch_multi_node.sh at step {max(before)}: all gone {outlived_s:.2f} s later")


def _host_name(address: str) -> str:
    done = subprocess.run(
        [FAKE_HOSTS, "rsh", address, "hostname"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _health_check(
    hosts, tmp_path, rsh: str, checkpoint_dir: Path
) -> tuple[subprocess.CompletedProcess, dict]:
    """scripts/test_distributed.py on both hosts through launch_multi_node.sh; (result, JSON report)."""
    (host0, _), hostfile = hosts
    out = tmp_path / "health.json"
    check = ["--max_bytes", "8K", "--iters", "3", "--json", str(out), "--checkpoint_dir", str(checkpoint_dir)]
    env = clean_env(HOSTFILE=str(hostfile), JAXTRAIN_RSH=rsh, JAXTRAIN_SCRIPT="scripts/test_distributed.py")
    done = subprocess.run(
        [*LAUNCH, host0, "2", "0", "--", *check],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


@pytest.mark.multihost
@pytest.mark.slow
def test_health_check_across_two_hosts(hosts, tmp_path):
    done, report = _health_check(hosts, tmp_path, f"{FAKE_HOSTS} rsh", tmp_path / "shared")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["healthy"] and report["bad_hosts"] == [], report["bad_processes"]
    assert report["environment"]["source"] == "jax_env" and report["environment"]["num_processes"] == 2
    assert [r["host"] for r in report["processes"]] == [_host_name(a) for a in hosts[0]]
    assert not (tmp_path / "shared").exists()


@pytest.mark.multihost
@pytest.mark.slow
def test_health_check_names_a_host_whose_checkpoint_dir_is_not_shared(hosts, tmp_path):
    """Host 1 sees its own empty tmpfs at the checkpoint dir, as a node-local disk would be."""
    (_, host1), _ = hosts
    private = tmp_path / "ckpt"
    private.mkdir()
    rsh = tmp_path / "rsh"
    rsh.write_text(
        "#!/bin/bash\n"
        f'if [[ $1 == {host1} ]]; then set -- "$1" "mount -t tmpfs jaxtrain-test {private} && $2"; fi\n'
        f'exec {FAKE_HOSTS} rsh "$1" "$2"\n'
    )
    rsh.chmod(0o755)
    done, report = _health_check(hosts, tmp_path, str(rsh), private)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error: node 0" in done.stderr or "error: node 1" in done.stderr
    storage = {c["name"]: c for c in report["checks"]}["storage"]
    assert not report["healthy"] and not storage["ok"]
    names = [_host_name(a) for a in hosts[0]]
    # Two hosts that each see only their own files: neither is the majority, so both are named.
    assert report["bad_hosts"] == sorted(names)
    bad = {b["process_id"]: b for b in storage["bad_processes"]}
    assert bad[1]["host"] == names[1] and "cannot see the files of processes [0]" in bad[1]["reason"]
    assert bad[0]["host"] == names[0] and "cannot see the files of processes [1]" in bad[0]["reason"]
    assert list(private.iterdir()) == []  # probes cleaned up; the tmpfs went with host 1's command


# `RSH HOST COMMAND` run here, whatever HOST; and a script whose rank argv[2] fails after a second.
HERE_RSH = '#!/bin/sh\nexec sh -c "$2"\n'
STAND_IN = """
import os, pathlib, sys, time
rank = int(os.environ["JAX_PROCESS_ID"])
pathlib.Path(sys.argv[1], f"started.{rank}").touch()
print(f"stand-in {rank}", flush=True)
time.sleep(1 if rank == int(sys.argv[2]) else 60)
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["node 1 fails", "Ctrl-C the launcher"])
def test_first_failure_or_ctrl_c_stops_every_node(how, tmp_path):
    """Both nodes on this machine, through a remote shell that runs the command here: no root."""
    rsh, script, hostfile = tmp_path / "rsh", tmp_path / "stand_in.py", tmp_path / "hosts"
    rsh.write_text(HERE_RSH)
    rsh.chmod(0o755)
    script.write_text(STAND_IN)
    hostfile.write_text("here0\nhere1\n")
    marker = uuid.uuid4().hex
    env = clean_env(
        HOSTFILE=str(hostfile), JAXTRAIN_RSH=str(rsh), JAXTRAIN_SCRIPT=str(script), JAXTRAIN_TEST_MARK=marker
    )
    failing = "1" if how == "node 1 fails" else "-1"
    launcher = subprocess.Popen(
        [*LAUNCH, "127.0.0.1", "2", "0", "--", str(tmp_path), failing],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(launcher, marker):
        if how == "Ctrl-C the launcher":
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"started.{r}").exists() for r in (0, 1)):
                assert launcher.poll() is None, launcher.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the stand-ins never started"
                time.sleep(0.2)
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    if how == "node 1 fails":
        assert launcher.returncode == 3, err[-3000:]
        assert "stand-in 0" in out and "[node 1] stand-in 1" in err
        assert "error: node 1 (here1) exited with code 3" in err
    else:
        assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
        assert "jaxtrain launch: got SIGINT, stopping all nodes" in err
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "expected 3 arguments, got 0"),
        (["10.0.0.1", "0", "8"], {}, "num_nodes must be a positive integer, got '0'"),
        (["10.0.0.1", "2", "-1"], {}, "gpus_per_node must be an integer >= 0, got '-1'"),
        (["10.0.0.1:99999", "2", "8"], {}, "coordinator must be HOST or HOST:PORT"),
        (["10.0.0.1", "2", "8", "--config"], {}, "training arguments go after --"),
        (["10.0.0.1", "2", "8"], {}, "set HOSTFILE"),
        (["10.0.0.1", "2", "8"], {"HOSTFILE": "/nonexistent"}, "is not a readable file"),
        (["10.0.0.1", "2", "8"], {"NODE_RANK": "2"}, "NODE_RANK must be in 0..1, got '2'"),
        (["10.0.0.1", "2", "8"], {"HOSTFILE": "/dev/null"}, "lists 0 hosts, need 2"),
        (["10.0.0.1", "1", "8"], {"HOSTFILE": __file__, "JAXTRAIN_RSH": "nope-rsh"}, "'nope-rsh' not found"),
    ],
)
def test_bad_arguments_exit_2(args, env, message):
    done = subprocess.run([*LAUNCH, *args], cwd=REPO, env=clean_env(**env), capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and message in done.stderr


def _namespace(address: str) -> str:
    """The network namespace of the fake host at `address` (scripts/dev/fake_hosts.sh's map)."""
    return Path("/run/jaxtrain_fake_hosts", address).read_text().strip()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _train_on(address: str, *args: str) -> list[str]:
    """scripts/train.py run on the fake host at `address`; both hosts share this filesystem, as
    nodes share an NFS or Lustre run dir."""
    train = shlex.join([sys.executable, "scripts/train.py", *args])
    return [str(FAKE_HOSTS), "rsh", address, f"cd {shlex.quote(str(REPO))} && exec {train}"]


@pytest.mark.multihost
@pytest.mark.slow
def test_a_run_dir_held_on_one_host_is_refused_on_another_and_taken_over_after_kill_9(hosts, tmp_path):
    (host0, host1), _ = hosts
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    env = clean_env(JAXTRAIN_TEST_MARK=marker)
    # A 3 s stale limit: the lock's heartbeat beats every 0.3 s; a dead holder's goes still.
    args = [*TINY, "--log_interval", "1", "--checkpoint_interval", "5", "--lock_stale_s", "3"]
    args += ["--run_dir", str(run_dir)]
    output = tmp_path / "host0.txt"  # a file, not a pipe: nobody reads it while host 0 trains
    with open(output, "w") as out:
        first = subprocess.Popen(
            _train_on(host0, *args, "--total_steps", "100000"),
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    with reaped(first, marker):
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "5" / "checksums.json").exists():
            said = output.read_text()[-3000:]
            assert first.poll() is None and time.monotonic() < deadline, f"host 0 never saved step 5:\n{said}"
            time.sleep(0.2)
        holder = [p for p in processes_marked(marker) if b"train.py" in _cmdline(p)]
        assert len(holder) == 1, holder
        t0 = time.monotonic()
        second = subprocess.run(_train_on(host1, *args), cwd=REPO, env=env, capture_output=True, text=True)
        refused_s = time.monotonic() - t0
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert f"is in use by another job (host {_host_name(host0)} pid {holder[0]} since " in last, last
        os.kill(holder[0], signal.SIGKILL)  # the holder's host "dies": its lock stays, still
        first.wait(timeout=30)
    assert (run_dir / "job.lock").exists()
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    t0 = time.monotonic()
    again = subprocess.run(
        _train_on(host1, *args, "--total_steps", str(saved + 3)),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    relaunch_s = time.monotonic() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    gone = f"left by a job that is gone (host {_host_name(host0)} pid {holder[0]} since"
    assert f"took over the lock of {run_dir} {gone}" in again.stderr, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/{saved}" in again.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, saved + 4))  # every step once
    assert not (run_dir / "job.lock").exists()
    print(f"refused on host 1 in {refused_s:.1f} s; after kill -9 on host 0: took over in {relaunch_s:.1f} s")


@pytest.mark.multihost
@pytest.mark.slow
def test_a_link_cut_between_hosts_mid_run_brings_the_whole_job_down_in_seconds(hosts, tmp_path):
    (host0, host1), hostfile = hosts
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    # Only steps, no eval or save: a cut inside a step is what the step watchdog bounds to seconds.
    # (Inside an eval or save only the absolute watchdog_timeout or JAX's 100 s heartbeat ends it.)
    args = [*TINY, "--total_steps", "100000", "--log_interval", "5", "--run_dir", str(run_dir)]
    args += ["--eval_interval", "0", "--checkpoint_interval", "100000"]
    launcher = subprocess.Popen(
        [*LAUNCH, host0, "2", "0", "--", *args],
        cwd=REPO, env=marked_env(hostfile, marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ns1 = _namespace(host1)
    veth = f"{ns1[:-1]}v1"  # host 1's end of the pair (fake_hosts.sh: PREFIXv1 in namespace PREFIX1)
    try:
        with reaped(launcher, marker):
            wait_for_training(run_dir, launcher)
            t0 = time.monotonic()
            subprocess.run(["ip", "-n", ns1, "link", "set", veth, "down"], check=True)
            _, err = launcher.communicate(timeout=120)
            down_s = time.monotonic() - t0
    finally:  # the module's other tests need the link
        subprocess.run(["ip", "-n", ns1, "link", "set", veth, "up"], check=True)
    assert launcher.returncode != 0, err[-3000:]
    assert re.search(r"error: node \d \(\S+\) exited with code \d+", err), err[-3000:]
    assert down_s < 60, f"{down_s:.0f} s"
    time.sleep(0.5)
    assert processes_marked(marker) == [], "processes left behind"
    print(f"link cut: the job ended with {launcher.returncode} in {down_s:.1f} s")
