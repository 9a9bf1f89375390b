"""How a model is split over the devices: one module per mesh axis, beside the one table that maps
the model's logical axes to mesh axes (`mesh`).

- `mesh`: the pipeline x data x expert x fsdp x context x tensor mesh, its device layout, and the
  rules table (logical axes -> mesh axes, param specs, ZeRO-1's specs).
- `data`: batch shards: the means over them and the gradient reduction, once a step.
- `fsdp`: params gathered a layer at a time (their gradients reduce-scattered), ZeRO-1's compute
  copy and its reduce-scatter over data.
- `tensor`: Megatron's splits the compiler cannot place alone (a gather or a reduce-scatter kept
  manual over tensor, the experts' hidden dim).
- `expert`: the token exchange of a mixture of experts (ragged all-to-all, XLA:CPU's stand-in).
- `context`: sequences split along their length; attention's all-to-all (Ulysses).
- `pipeline`: stages of layers and their schedule.
- `placement`: the hooks a model is given to run split (model/placement.py's Placement), made
  from these for one mesh.

The model (model/) names logical axes only and runs as on one device unless given a Placement.
"""
