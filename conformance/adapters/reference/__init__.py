"""The reference as an implementation under test: its kernel (:mod:`.kernel`, ``--backend reference``) and
its configuration rules (:mod:`.rules`, ``--engine reference``)."""
