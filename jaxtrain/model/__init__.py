"""The transformer, as flax modules: `transformer` (GPT and the Llama family: blocks, MLP,
embeddings), `attention` (the layer and its kernel: cuDNN's fused attention or XLA's), `layers`
(dense, RMSNorm, rotary positions, layout constraints), `params` (logical axes by param path,
names, counts), `generate` (KV-cached sampling). Knows no mesh and no device."""
