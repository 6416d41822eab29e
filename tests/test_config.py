"""Hydra model configs agree with the dataclasses; derived quantities of the spec."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_duplex.config import DtypeConfig, ModelConfig, model_config_from_dict, tiny_config

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"


@pytest.mark.parametrize("name, expected", [("nemotron_duplex", ModelConfig()),
                                            ("nemotron_duplex_tiny", tiny_config())])
def test_yaml_equals_dataclass(name, expected):
    cfg = model_config_from_dict(OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"), resolve=True))
    assert cfg == expected


def test_tiny_has_every_kind_of_layer():
    c = tiny_config()
    assert set(c.llm.hybrid_override_pattern) == {"M", "*", "-"}
    kinds = {c.talker.backbone.is_full_attention(i) for i in range(c.talker.backbone.num_hidden_layers)}
    assert kinds == {True, False}
    assert c.talker.num_quantizers == 31 and c.samples_per_frame_out == 1764


def test_spec_derived_numbers():
    c = ModelConfig()
    assert c.talker.unmask_schedule() == [0, 0, 0, 1, 1, 3, 4, 22]     # spec 4.6
    assert c.prompt_frames == 37 and c.samples_per_frame_in == 1280     # spec 4.3, 1.2
    assert c.llm.layer_indices("*") == [14, 21, 30, 39] and len(c.llm.layer_indices("M")) == 27  # spec 3.2
    assert c.llm.mamba_d_inner == 10240 and c.llm.mamba_conv_dim == 12288                   # spec 3.3


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="codec must be fp32"):
        DtypeConfig(codec="bf16")
    with pytest.raises(ValueError, match="unknown fields"):
        model_config_from_dict({"llm": {"hidden": 3}})
