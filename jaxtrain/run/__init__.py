"""The training run, in the order a launch meets it: `job` (where this process sits; the config
resolved on its devices), `mesh` (devices laid out, params and batches sharded), `build` (the run
built once: model, optimizer, state shapes and shardings, jitted `step`s over `state` and
`optim`), `start` (resume or init), `loop` (train) or `tasks` (test, predict), beside `evaluate`
(the validation-loss rule), `preemption` (stop signals) and `background` (compile while restoring).
"""
