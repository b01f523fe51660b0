"""Server scenarios (docs/contracts.md section 6) against the server under test: the reference server by default,
any engine through ``--server-cmd`` or ``--server-url``, on the fixture checkpoints or on your own
(``--server-checkpoint``). Cases (config x checkpoint x scenario) come from conformance/server/plugin.py;
the scenarios themselves are in conformance/server/scenarios.py."""


def test_server_scenario(server_case, server_pool, record_property, request):
    try:
        server_pool.run(server_case, record_property)
    finally:
        server_pool.release(request.node.nodeid)
