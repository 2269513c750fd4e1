"""Device kernels behind small interfaces, each with a torch reference implementation.

- `loraplex_kernels.lora_pages`: adapter weights stored inside the KV page pool, paged along the
  rank dimension (the layout, writing an adapter into its pages, reading it back).
- `loraplex_kernels.lora`: the segmented multi-LoRA delta (punica SGMV semantics) over those
  pages; on the CPU in float32 it runs the fused C++ kernel of `loraplex_kernels.cpu_lora` (built
  at first use).
- `loraplex_kernels.attention`: paged KV writes and attention over block tables.
Triton kernels will replace the references on the GPU behind the same signatures.
"""
