"""jaxtrain: a JAX trainer for transformer language models, from one CPU to many GPU hosts.

A launch: config/ (schema, loading) -> cluster.detect -> job (where this process sits) -> run (the
build: model, optimizer, state shapes and shardings, jitted steps) -> loop (train) or tasks (test,
predict); plan.py and targets.py compile the same build for GPUs that are not here. README's
Layout section lists every module.
"""
