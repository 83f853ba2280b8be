"""Config `offload.stream_modules`: which modules stream in mode block/phase, and its refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runnerkit.config import OffloadConfig
from runnerkit.runners.default import stream_choice
from runnerkit.runners.fit import ModuleFootprint, streams
from runnerkit.runners.pipeline import DecoderStage, DenoiseStage, EncoderStage, ModuleSpec, OutputSpec, Pipeline


def _pipeline() -> Pipeline:
    def build(device):
        raise AssertionError("not built in these tests")

    def stream():
        raise AssertionError("not streamed in these tests")

    return Pipeline(
        modules=(ModuleSpec("text_encoder", "text_encoder", build=build, stream=stream),
                 ModuleSpec("transformer", "transformer", build=build, stream=stream),
                 ModuleSpec("vae", "decoder", build=build)),
        encoders=(EncoderStage("text_encoder", module="text_encoder", run=lambda info, x: x),),
        denoise=(DenoiseStage("transformer", transformers=("transformer",), steps=4, scheduler="unipc", shift=1.0,
                              spacing="diffusers", latent_shape=lambda shape: (1, 4, 1, 2, 2)),),
        decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=lambda latents: latents),),
        outputs=(OutputSpec("video", "video"),))


def test_default_streams_the_transformers_only():
    assert [m.name for m in stream_choice(_pipeline(), None, "R")] == ["transformer"]


def test_listed_modules_stream_in_pipeline_order():
    got = stream_choice(_pipeline(), ["transformer", "text_encoder"], "R")
    assert [m.name for m in got] == ["text_encoder", "transformer"]


def test_a_module_that_cannot_stream_is_refused_with_the_ones_that_can():
    with pytest.raises(ValueError, match=r"R cannot stream \['vae'\]; modules that can stream: "
                                         r"\['text_encoder', 'transformer'\]"):
        stream_choice(_pipeline(), ["vae"], "R")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "model", "stream_modules": ["transformer"]}, "has no effect with `offload.mode`='model'"),
    ({"mode": "block", "stream_modules": []}, "is empty"),
    ({"mode": "block", "stream_modules": ["a", "a"]}, r"lists \['a'\] more than once"),
])
def test_config_refusals(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        OffloadConfig(**kwargs)


def test_fit_counts_a_listed_text_encoder_as_streamed():
    encoder = ModuleFootprint(weight_bytes=100, stream_resident_bytes=10, stream_slot_bytes=20, stream_default=False)
    assert not streams("text_encoder", encoder, OffloadConfig(mode="block"))
    assert streams("text_encoder", encoder, OffloadConfig(mode="block", stream_modules=["text_encoder"]))
    assert not streams("text_encoder", encoder, OffloadConfig(mode="model"))
    transformer = ModuleFootprint(weight_bytes=100, stream_resident_bytes=10, stream_slot_bytes=20)
    assert streams("transformer", transformer, OffloadConfig(mode="block"))
    assert not streams("transformer", transformer, OffloadConfig(mode="block", stream_modules=["text_encoder"]))


def test_the_config_stays_hashable_with_a_list_of_modules():
    """The families' estimates cache their footprints on the offload config (functools.lru_cache)."""
    from runnerkit.config import load_runner_config
    from test_cases.conftest import TINY_CONFIG

    config = load_runner_config(TINY_CONFIG, {"offload": {"mode": "block", "stream_modules": ["transformer",
                                                                                              "text_encoder"]}})
    assert config.offload.stream_modules == ("transformer", "text_encoder")
    assert hash(config.offload) == hash(OffloadConfig(mode="block", stream_modules=["transformer", "text_encoder"]))
    assert config.model_dump(mode="json")["offload"]["stream_modules"] == ["transformer", "text_encoder"]
