"""Config `offload.stream_modules`: which modules stream in mode block/phase, and its refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runnerkit.config import OffloadConfig
from runnerkit.runners.default import stream_choice
from runnerkit.planning.fit import ModuleFootprint, streams
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
        encoders=(EncoderStage("text_encoder", module="text_encoder", run=lambda req: req.inputs),),
        denoise=(DenoiseStage("transformer", transformers=("transformer",), steps=4, scheduler="unipc", shift=1.0,
                              spacing="diffusers", latent_shape=lambda shape: (1, 4, 1, 2, 2)),),
        decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=lambda req, latents: latents),),
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


FAMILY_CONFIGS = {  # tiny config -> the modules its runner can stream
    "wan/wan_t2v_tiny.json": ["text_encoder", "transformer"],
    "wan/wan_i2v_tiny.json": ["text_encoder", "transformer"],
    "wan/wan22_moe_t2v_tiny.json": ["text_encoder", "transformer", "transformer_2"],
    "ltx2/ltx2_t2av_tiny.json": ["connectors", "text_encoder", "transformer"],
    "qwen_image/qwen_image_t2i_tiny.json": ["text_encoder", "transformer"],
}


@pytest.mark.parametrize("mode", ["auto", "block"])
@pytest.mark.parametrize("config_file", list(FAMILY_CONFIGS))
def test_a_name_that_cannot_stream_is_refused_when_the_runner_is_built(config_file, mode):
    """Before planning or loading: the field, the value, the bad names and the family's allowed ones."""
    from runnerkit.config import load_runner_config
    from runnerkit.registry import get_runner_cls
    from test_cases.conftest import REPO

    listed = ["vae", "transformer", "texte_encoder"]
    config = load_runner_config(REPO / "configs" / config_file, {"offload": {"mode": mode, "stream_modules": listed}})
    runner_cls = get_runner_cls(config.model_cls, config.task)
    assert sorted(runner_cls.STREAM_MODULES) == FAMILY_CONFIGS[config_file]
    with pytest.raises(ValueError) as err:
        runner_cls(config)
    assert str(err.value) == (
        f"`offload.stream_modules`={listed}: ['vae', 'texte_encoder'] cannot stream in model_cls "
        f"{config.model_cls!r} (task {config.task!r}, {runner_cls.__name__}); modules that can: "
        f"{list(runner_cls.STREAM_MODULES)}")
    ok = load_runner_config(REPO / "configs" / config_file,
                            {"offload": {"mode": mode, "stream_modules": list(runner_cls.STREAM_MODULES)}})
    runner_cls(ok)  # every allowed name is accepted


def test_the_launch_script_refuses_it_before_planning(tmp_path, capsys):
    from runnerkit.infer import main

    rc = main(["--config_json", str(_with_stream_modules(tmp_path, ["vae"])), "--device", "cpu", "--prompt", "a fox"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "`offload.stream_modules`=['vae']: ['vae'] cannot stream in model_cls 'wan2.1'" in err, err
    assert "modules that can: ['text_encoder', 'transformer']" in err, err
    assert "memory plan" not in err and "Every candidate is excluded" not in err and "load: " not in err, err


def _with_stream_modules(tmp_path, names):
    import json

    from test_cases.conftest import TINY_CONFIG

    data = json.loads(TINY_CONFIG.read_text())
    data["offload"] = {"mode": "auto", "stream_modules": names}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    return path
