"""What training and the health check share about a cluster: where this process sits in the job
(`detect`, no jax), joining the other processes (`join`), and the hang watchdog (`watchdog`,
which also keeps the health check's deadlines).

The launchers (`jaxtrain.launch`) use only `detect`, so they start without importing jax.
"""
