"""The one list of supported model families, and its refusal line."""

import json

from slime_stoa.protocol.hf.architectures import SUPPORTED_MODEL_TYPES, unsupported_config, unsupported_model


def test_supported_families_pass_and_others_are_named(tmp_path):
    for model_type in SUPPORTED_MODEL_TYPES:
        assert unsupported_config({"model_type": model_type}) == ""
    why = unsupported_config({"model_type": "gpt2"})
    assert "'gpt2' is not supported" in why and "llama" in why and "lfm2_moe" in why
    assert "missing" in unsupported_config({})


def test_folder_problems_are_one_line_naming_the_folder(tmp_path):
    assert "cannot read config.json" in unsupported_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in unsupported_model(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    assert "not a JSON object" in unsupported_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    line = unsupported_model(tmp_path)
    assert line.startswith(str(tmp_path)) and "\n" not in line
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert unsupported_model(tmp_path) == ""
    (tmp_path / "config.json").write_bytes(b" " * (2 << 20))
    assert "larger than" in unsupported_model(tmp_path)
