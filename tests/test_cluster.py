"""jaxtrain.cluster: where each launch source puts a process, and real gloo start-ups on CPU.

pytest tests/test_cluster.py                  # all (about 30 s on 2 cores)
pytest tests/test_cluster.py -m "not multiprocess"   # detection only, instant
"""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import clean_env

from jaxtrain.cluster.detect import LaunchSpec, coordinator_reachable, detect
from jaxtrain.config import DistConfig
from jaxtrain.errors import UserError

REPO = Path(__file__).resolve().parent.parent
D = DistConfig()

SLURM_2x2 = {  # rank 3 of 4: two nodes, two tasks each, this task is the second on node 1
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}
SLURM_1x2 = {**SLURM_2x2, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
SLURM_1x2["SLURM_STEP_TASKS_PER_NODE"] = "1(x2)"
TORCH = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5"}
JAX = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
FLAGS = DistConfig(coordinator_address="10.0.0.3:999", num_processes=2, process_id=1)
OMPI = {  # what Open MPI 4.1's mpirun -np 4 gives rank 3, the second of two on its host
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_orte_hnp_uri": "1611005952.0;tcp://192.0.2.2,10.1.0.1:49167;tcp6://[fd00::2]:52699",
}


def test_nothing_set_is_a_single_process():
    assert detect(D, {}) == LaunchSpec("single", None, 1, 0, None, {})


@pytest.mark.parametrize(
    "dist, env, source, coordinator, n, pid",
    [
        (FLAGS, {**JAX, **TORCH, **SLURM_2x2}, "flags", "10.0.0.3:999", 2, 1),
        (D, {**JAX, **TORCH, **SLURM_2x2}, "jax_env", "10.0.0.2:1234", 4, 2),
        (D, {**TORCH, **SLURM_2x2}, "torchrun_env", "10.0.0.1:29500", 8, 5),
        (D, SLURM_2x2, "slurm", f"gpu007:{4242 % 4096 + 61440}", 4, 3),
        # JAX's own rule: job id 1611005952 // 4096 % 4096 + 61440
        (D, {**OMPI, **SLURM_2x2}, "openmpi", "192.0.2.2:61536", 4, 3),
        (D, {**TORCH, "TORCHELASTIC_RUN_ID": "r"}, "torchrun_env", "10.0.0.1:29501", 8, 5),
        (DistConfig(num_processes=1), {}, "flags", None, 1, 0),
        (D, {**JAX, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}, "jax_env", None, 1, 0),
    ],
)
def test_first_source_wins(dist, env, source, coordinator, n, pid):
    spec = detect(dist, env)
    assert (spec.source, spec.coordinator_address, spec.num_processes, spec.process_id) == (
        source,
        coordinator,
        n,
        pid,
    )


def test_details_record_the_values_used():
    assert detect(D, JAX).details == JAX
    assert detect(D, SLURM_2x2).details["SLURM_STEP_NODELIST"] == "gpu[007-008]"


@pytest.mark.parametrize(
    "coordinator_env, expected",
    [
        ({"MASTER_ADDR": "head", "MASTER_PORT": "29400"}, "head:29400"),
        ({"JAX_COORDINATOR_ADDRESS": "head:5000"}, "head:5000"),
    ],
)
def test_slurm_takes_a_coordinator_given_alone(coordinator_env, expected):
    spec = detect(D, {**SLURM_2x2, **coordinator_env})
    assert (spec.source, spec.coordinator_address) == ("slurm", expected)
    flag = detect(DistConfig(coordinator_address="h:7"), SLURM_2x2)
    assert (flag.source, flag.coordinator_address) == ("slurm", "h:7")


@pytest.mark.parametrize(
    "nodelist, host",
    [("node001", "node001"), ("a,b", "a"), ("n[003-005,9],m", "n003"), ("gpu[12,14]", "gpu12")],
)
def test_slurm_coordinator_is_the_first_node(nodelist, host):
    spec = detect(D, {**SLURM_1x2, "SLURM_STEP_NODELIST": nodelist})
    assert spec.coordinator_address.rsplit(":", 1)[0] == host


@pytest.mark.parametrize(
    "env, devices",
    [
        (SLURM_1x2, None),  # one task per node: all its GPUs
        (SLURM_2x2, (1,)),  # one task per GPU, nothing bound: GPU = local id
        ({**SLURM_2x2, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (2, 3)),  # 4 GPUs, 2 tasks: halves
        ({**SLURM_2x2, "CUDA_VISIBLE_DEVICES": "5"}, None),  # SLURM bound one GPU to the task
        ({**SLURM_2x2, "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, None),
        ({**TORCH, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, (3,)),
        ({**TORCH, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, None),
        ({**JAX, "JAX_LOCAL_DEVICE_IDS": "4,5"}, (4, 5)),
        (OMPI, (1,)),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, None),
    ],
)
def test_local_devices(env, devices):
    assert detect(D, env).local_device_ids == devices


@pytest.mark.parametrize(
    "coordinator_env, expected",
    [
        ({"JAX_COORDINATOR_ADDRESS": "head:5000"}, "head:5000"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "7"}, "h:7"),
    ],
)
def test_open_mpi_takes_a_coordinator_given_alone(coordinator_env, expected):
    no_uri = {k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}  # Open MPI 5
    spec = detect(D, {**no_uri, **coordinator_env})
    assert (spec.source, spec.coordinator_address, spec.local_rank) == ("openmpi", expected, 1)


def test_local_device_ids_flag_overrides_any_source():
    spec = detect(DistConfig(local_device_ids="6, 7"), SLURM_2x2)
    assert (spec.source, spec.local_device_ids) == ("slurm", (6, 7))


@pytest.mark.parametrize(
    "dist, env, message",
    [
        (D, {"MASTER_ADDR": "h"}, "MASTER_ADDR set but MASTER_PORT, WORLD_SIZE, RANK not"),
        (D, {"WORLD_SIZE": "2", "RANK": "0"}, "set but MASTER_ADDR, MASTER_PORT not"),
        (D, {"LOCAL_RANK": "1"}, "LOCAL_RANK set but"),
        (D, {**TORCH, "RANK": "8"}, "RANK=8 is out of range for WORLD_SIZE=8"),
        (D, {**TORCH, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        (D, {**TORCH, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
        (D, {**TORCH, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
        (D, {"JAX_NUM_PROCESSES": "2"}, "JAX_NUM_PROCESSES set but JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID"),
        (D, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_COORDINATOR_ADDRESS set but"),
        (D, {**JAX, "JAX_PROCESS_ID": "-1"}, "JAX_PROCESS_ID=-1 is out of range"),
        (D, {**JAX, "JAX_COORDINATOR_ADDRESS": "nohost"}, "'nohost' is not HOST:PORT"),
        (D, {**JAX, "JAX_COORDINATOR_ADDRESS": "h:70000"}, "'h:70000' is not HOST:PORT"),
        (D, {**JAX, "JAX_LOCAL_DEVICE_IDS": "0,0"}, "must be distinct non-negative device ids"),
        (DistConfig(num_processes=2), {}, "--dist.num_processes set but --dist.coordinator_address"),
        (DistConfig(coordinator_address="h:1"), {}, "--dist.coordinator_address set but"),
        (DistConfig(num_processes=2, process_id=2, coordinator_address="h:1"), {}, "out of range"),
        (DistConfig(local_device_ids="a"), {}, "--dist.local_device_ids='a' must be"),
        (D, {**SLURM_2x2, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is out of range for SLURM_NTASKS=4"),
        (D, {k: v for k, v in SLURM_2x2.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID"),
        (D, {**SLURM_2x2, "MASTER_ADDR": "h"}, "set both MASTER_ADDR and MASTER_PORT"),
        (D, {**SLURM_2x2, "CUDA_VISIBLE_DEVICES": "0,1,2"}, "3 GPUs (CUDA_VISIBLE_DEVICES) cannot be split"),
        (D, {k: v for k, v in SLURM_2x2.items() if k != "SLURM_STEP_ID"}, "start training with srun"),
        (
            D,
            {**TORCH, "MASTER_PORT": "65535", "TORCHELASTIC_RUN_ID": "r"},
            "pass torchrun a lower --master_port",
        ),
        (
            D,
            {k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"},
            "mpirun -x JAX_COORDINATOR_ADDRESS",
        ),
        (D, {"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE set but OMPI_COMM_WORLD_RANK"),
        (
            D,
            {"PMI_SIZE": "4", "PMI_RANK": "1"},
            "PMI_SIZE=4: a launcher jaxtrain cannot read started several",
        ),
        (D, {"MV2_COMM_WORLD_SIZE": "2"}, "MV2_COMM_WORLD_SIZE=2: a launcher jaxtrain cannot read"),
    ],
)
def test_inconsistent_values_are_one_line_errors(dist, env, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        detect(dist, env)
    assert "\n" not in str(e.value)


def test_salloc_shell_is_not_a_task():
    """Inside salloc but not started by srun (no SLURM_PROCID): run as one process."""
    env = {k: v for k, v in SLURM_2x2.items() if k not in ("SLURM_PROCID", "SLURM_LOCALID")}
    assert detect(D, env).source == "single"


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_coordinator_reachable():
    with _listener() as s:
        port = s.getsockname()[1]
        assert coordinator_reachable(f"127.0.0.1:{port}", 1.0)
    assert not coordinator_reachable(f"127.0.0.1:{port}", 1.0)


# ---------------------------------------------------------------- real processes (gloo on CPU)

WORKER = """
import sys
from jaxtrain.config import DistConfig
from jaxtrain.cluster.join import initialize
from jaxtrain.cluster.shutdown import exit_on_user_error
spec = exit_on_user_error(initialize)(DistConfig(init_timeout=int(sys.argv[1])))
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1])).sum()
print(f"OK source={spec.source} process={jax.process_index()}/{jax.process_count()} "
      f"devices={jax.device_count()} sum={int(total)}", flush=True)
"""


def start(env: dict[str, str], timeout: int = 60) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(timeout)], env=env, cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["jax_env", "torchrun_env"])
def test_two_processes_join_over_gloo(source):
    port = free_port()
    procs = []
    for rank in (0, 1):
        if source == "jax_env":
            env = clean_env(
                2,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(rank),
            )
        else:
            env = clean_env(2, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        procs.append(start(env))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-2000:]
        assert f"OK source={source} process={rank}/2 devices=4 sum=3" in out
    # process 0 alone says where it sits
    assert f"distributed: source={source} process 0/2" in outs[0][0]
    assert "distributed:" not in outs[1][0]


@pytest.mark.multiprocess
def test_unreachable_coordinator_fails_within_the_timeout():
    port = free_port()  # nobody listens here
    env = clean_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    t0 = time.monotonic()
    p = start(env, timeout=3)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 20
    assert p.returncode == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"error: process 1 of 2 (coordinator 127.0.0.1:{port}, source jax_env) could not reach the "
            "coordinator within 3 s"
        )
    )


@pytest.mark.multiprocess
def test_missing_peers_time_out_with_a_readable_error():
    """Process 0 starts the coordinator, but process 1 never comes: exit 2, not an abort or a hang."""
    port = free_port()
    env = clean_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
    t0 = time.monotonic()
    p = start(env, timeout=3)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 20
    assert p.returncode == 2
    assert err.strip().splitlines()[-1] == (
        f"error: process 0 of 2 (coordinator 127.0.0.1:{port}, source jax_env) timed out after 3 s waiting "
        "for all processes to join; start every process, check they agree on the coordinator, or raise "
        "--dist.init_timeout"
    )


@pytest.mark.multiprocess
def test_coordinator_port_in_use():
    with _listener() as s:
        port = s.getsockname()[1]
        env = clean_env(
            2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"
        )
        p = start(env, timeout=10)
        _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert f"port {port} is already in use on this host" in err
