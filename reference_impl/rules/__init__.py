"""Configuration rules of the engines as the reference models them: SGLang's (:mod:`.sglang`, its code paths
:mod:`.sglang_paths`), vLLM's (:mod:`.vllm`), the LM-head guard (:mod:`.lm_head`) and weight reloads (:mod:`.reload`)."""
