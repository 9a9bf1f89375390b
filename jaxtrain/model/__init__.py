"""The transformer, as flax modules: `transformer` (GPT and the Llama family: blocks, embeddings),
`attention` (the layer and its kernels: cuDNN's fused attention or XLA's), `mla` (DeepSeek's latent
attention), `mlp` (the dense feed-forward), `moe` (routed experts), `grouped` and `grouped_kernels`
(the experts' Pallas kernels on Hopper), `head` (logits and the loss in pieces), `documents`
(packed documents), `layers` (dense, RMSNorm, rotary positions, layout constraints), `params`
(logical axes by param path, names, counts), `placement` (the hooks a split model is given),
`generate` (KV-cached sampling), `auto` (what `auto` means for each kernel, on which devices).

Knows no devices and no topology: params and activations name logical axes (`layers.constrain`),
which the step's rules map to mesh axes (parallel/mesh.py). No layer reads a mesh or runs a
collective: where a split model computes differently (a layer's params gathered, attention per
device, experts exchanged) it calls the hook its `Placement` holds (parallel/placement.py makes
them); without one it runs as on one device. tests/test_layout.py keeps it so."""
