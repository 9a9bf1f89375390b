"""XLA_FLAGS as jaxtrain sets them (jaxtrain/xla_env.py): ours added, the user's own win."""

from jaxtrain.xla_env import CPU_FLAGS, GPU_FLAGS, merged_flags


def test_the_users_flag_wins_and_ours_fill_in_the_rest():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    flags = merged_flags(mine, (*CPU_FLAGS, *GPU_FLAGS)).split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert set(GPU_FLAGS[1:]) | set(CPU_FLAGS) | {"--xla_dump_to=/tmp/x"} <= set(flags)
    assert len(flags) == len(CPU_FLAGS) + len(GPU_FLAGS) + 1
