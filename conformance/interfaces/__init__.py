"""What you bring, and the one class each brings it in as (select it with the option named):

* your W4A16 kernel: :class:`conformance.interfaces.kernel.Backend` (``--backend module:attr``);
* your engine's configuration rules: :class:`conformance.interfaces.rules.RulesEngine` (``--engine module:attr``);
* your engine's layer code under the FlashInfer emulator: :class:`conformance.interfaces.layer_code.LayerCodeEngine`
  (``--engine module:attr``);
* your server: :class:`conformance.interfaces.server.ServerDialect` (``--server-api``; ``--server-cmd`` or
  ``--server-url``).

Built-in implementations are plain subclasses in the area packages (``conformance.backends``, ``conformance.rules``,
``conformance.engine_harness``, ``conformance.server``).
"""
