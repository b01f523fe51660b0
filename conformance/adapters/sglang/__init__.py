"""SGLang 0.5.23: its configuration rules (:mod:`.rules`, :mod:`.rule_paths`; import stand-ins in :mod:`._import`),
its layer code under the FlashInfer emulator (:mod:`.layer_code`, :mod:`.a2a_prefill`) and its native HTTP API
(:mod:`.server`)."""
