"""Device kernels behind small interfaces, each with a torch reference implementation.

- `loraplex_kernels.lora_pages`: adapter weights stored inside the KV page pool, paged along the
  rank dimension (the layout, writing an adapter into its pages, reading it back).
- `loraplex_kernels.lora`: the segmented multi-LoRA delta (punica SGMV semantics) over those
  pages; on CUDA it runs the Triton kernels of `loraplex_kernels.triton_lora` (SGMV for prefill,
  one program per row for decode), on the CPU in float32 the fused C++ kernel of
  `loraplex_kernels.cpu_lora` (built at first use) (`LORAPLEX_LORA_KERNEL`).
- `loraplex_kernels.attention`: paged KV writes and attention over block tables (decode rows and
  varlen chunked prefill); on CUDA it runs the Triton kernels of `loraplex_kernels.triton_attention`
  (`LORAPLEX_ATTENTION_KERNEL`).
Triton kernels will replace the references on the GPU behind the same signatures.
"""
