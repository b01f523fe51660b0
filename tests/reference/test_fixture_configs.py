"""The fixture builder writes config.json without transformers (it runs in the main install); transformers'
own config classes must read back every value it wrote (needs the ``test`` extra: transformers)."""
from __future__ import annotations

import pytest

from fixtures.make_checkpoints import hf_config

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[test]'")


@pytest.mark.parametrize("arch,cls", [("dense", "LlamaConfig"), ("moe", "Qwen3MoeConfig")])
def test_transformers_reads_the_fixture_config(arch, cls):
    ours = hf_config(arch)
    config = getattr(transformers, cls)(**{k: v for k, v in ours.items() if k not in ("architectures", "model_type")})
    assert config.model_type == ours["model_type"]
    skipped = {"architectures", "model_type", "torch_dtype", "rope_theta", "rope_parameters", "num_local_experts"}
    for key, value in ours.items():
        if key not in skipped:
            assert getattr(config, key) == value, key
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    assert rope["rope_theta"] == ours["rope_theta"]
