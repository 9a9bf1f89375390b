"""What a run tells people: `metrics` (logging, the log line, metrics.jsonl, wandb), `tboard`
(TensorBoard scalars), `peaks` (devices' peak FLOP/s, for MFU), `goodput` (where a run's wall
time went), `profiling` (jax traces), `memory` (a device's limit, a compiled step's bytes, the one
"fits" rule, out of memory as one line), `plot` (a run's curves and goodput as one PNG), `gemms` (a
compiled step's GEMMs by kind, and the check an FP8 job's step passes where it starts)."""
