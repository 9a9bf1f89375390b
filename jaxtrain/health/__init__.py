"""The cluster health check behind scripts/test_distributed.py: `cli` reads its flags, `runner`
runs the steps, `checks` holds each step's measurement and verdict and the report, `exchange`
carries messages between the processes (and probes the shared storage). The deadlines use
jaxtrain.cluster.watchdog.
"""
