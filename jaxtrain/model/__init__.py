"""The transformer, as flax modules: `transformer` (GPT and the Llama family: blocks, MLP,
embeddings), `attention` (the layer and its kernel: cuDNN's fused attention or XLA's), `layers`
(dense, RMSNorm, rotary positions, layout constraints), `params` (logical axes by param path,
names, counts), `generate` (KV-cached sampling).

Knows no devices and no topology: params and activations name logical axes (`layers.constrain`),
which the step's rules map to mesh axes. Two layers read the abstract mesh of the step they are
traced in (jax.sharding.get_abstract_mesh, never a Mesh or a device): attention, to run its kernel
on each device's own rows and heads, and the mixture of experts, to exchange tokens over the axis
its experts are split on. Outside a step both run as on one device."""
