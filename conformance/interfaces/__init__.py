"""What you bring, and the one class each brings it in as (select it with the option named):

* your W4A16 kernel: :class:`conformance.interfaces.kernel.Backend` (``--backend module:attr``);
* your engine's configuration rules: :class:`conformance.interfaces.rules.RulesEngine` (``--engine module:attr``);
* your engine's layer code under the FlashInfer emulator: :class:`conformance.interfaces.layer_code.LayerCodeEngine`
  (``--engine module:attr``);
* your server: :class:`conformance.interfaces.server.ServerDialect` (``--server-api``; ``--server-cmd`` or
  ``--server-url``).

Built-in implementations are plain subclasses in the vendor folders (``conformance.adapters.<vendor>``); the one
standard API, the OpenAI-compatible server dialect, ships here beside its interface
(:class:`conformance.interfaces.server_openai.OpenAIDialect`). The other modules here are the value types and small
helpers those implementations build on: :mod:`.standin` (the FlashInfer emulator in ``flashinfer``'s place),
:mod:`.hardware` (GPUs, the ``b200`` emulation switch), :mod:`.upstream_source` (running an engine's own statements
from its installed source), :mod:`.server_types` / :mod:`.server_pace`. This package imports nothing else of
``conformance``: adapters may import only it and ``reference_impl``.
"""
