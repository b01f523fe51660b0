"""FlashInfer's W4A16 kernels as backends: the dense GEMM (:mod:`.kernel`), the CuTe DSL fused MoE (:mod:`.moe`)
and what decides whether they can run here, real or emulated (:mod:`.platform`)."""
