"""vLLM 0.32: its NVFP4 kernel selection (:mod:`.rules`, :mod:`.rules_moe`; platform stand-in in :mod:`._import`),
its layer code under the FlashInfer emulator (:mod:`.layer_code`) and its server API (:mod:`.server`)."""
