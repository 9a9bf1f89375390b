"""jaxtrain: a JAX trainer for transformer language models, from one CPU to many GPU hosts.

A launch: config/ (schema, loading) -> cluster.detect -> run/ (job: where this process sits;
build: the run built once, model/ and its sharding on parallel.mesh; start, then loop or tasks); data/
feeds it, disk/ keeps it, observe/ reports it; plan/ compiles the same build for GPUs that are
not here. No module imports a room above its own (tests/test_layout.py). docs/layout.md
lists every module.
"""
