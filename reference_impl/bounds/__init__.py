"""The derived error bounds every check compares against: the W4A16 dense linear (:mod:`.dense`) and the fused
MoE (:mod:`.moe`), measured from the exact fp64 value of the dequantized model (no implementation is the truth).
The suite's areas (dense, MoE, engine layer code, the FlashInfer comparison) share them."""
