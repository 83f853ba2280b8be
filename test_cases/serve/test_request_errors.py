"""Refusals of `build_request` and `seconds`, word for word: each names the field as the client sent it, the
value, and what is allowed. The tiny runners are only built (no checkpoint is read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runnerkit.planning.fit import MemoryFitError
from runnerkit.serve.app import InputError, _frames_of, build_request
from runnerkit.registry import get_runner_cls
from runnerkit.serve.app import ServerState
from runnerkit.serve.jobs import JobQueue
from test_cases.serve.test_units import _png, _qwen_edit_state, _wan_i2v_state

SECONDS_ALLOWED = ("0.625 to 128.125 seconds (5 to 1025 frames at 8 fps, each shown 1/8 s; `target_video_length: 1` "
                   "for a single frame)")


def _wan_t2v_state(tmp_path: Path) -> Any:
    """The tiny Wan i2v config as t2v (no image input), only built."""
    state = _wan_i2v_state(tmp_path)
    config = state.runner.config.model_copy(update={"task": "t2v"})
    runner = get_runner_cls(config.model_cls, config.task)(config)
    return ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")


def _refusal(state: Any, body: dict[str, Any], tmp_path: Path) -> InputError:
    folder = tmp_path / "job"
    folder.mkdir(exist_ok=True)
    with pytest.raises(InputError) as exc:
        build_request(state, body, folder)
    return exc.value


@pytest.mark.parametrize(("state", "task_images"), [(_qwen_edit_state, "`image`, `extra_images`"),
                                                    (_wan_i2v_state, "`image` (or `input_reference`)")],
                         ids=["i2i", "i2v"])
def test_a_mask_is_refused_listing_only_the_images_the_task_takes(tmp_path: Path, state: Any, task_images: str) -> None:
    png = _png()
    server = state(tmp_path)
    exc = _refusal(server, {"prompt": "x", "image": png, "mask": png}, tmp_path)
    assert (exc.field, str(exc)) == ("mask", f"`mask` (an uploaded file of {len(png)} bytes) is not a field of this "
                                             f"endpoint; task {server.runner.config.task!r} takes files in: {task_images}")


@pytest.mark.parametrize(("state", "takes"), [(_wan_i2v_state, "task 'i2v' takes files in: `image` (or `input_reference`)"),
                                              (_wan_t2v_state, "task 't2v' takes no file")], ids=["i2v", "t2v"])
def test_a_prompt_sent_as_a_file_is_a_text_field(tmp_path: Path, state: Any, takes: str) -> None:
    exc = _refusal(state(tmp_path), {"prompt": b"a cat"}, tmp_path)
    assert (exc.field, str(exc)) == ("prompt", "`prompt` is a text field, not a file (got an uploaded file of 5 bytes); "
                                               + takes)


I2V_FIELDS = ("`prompt`, `negative_prompt`, `image`, `input_reference`, `seed`, `target_height`, `target_width`, "
              "`target_video_length`, `enhance_prompt`, `size`, `seconds`, `model`")


@pytest.mark.parametrize(("options", "accepted"), [
    ((), I2V_FIELDS), (("n", "quality"), I2V_FIELDS + ", `n`, `quality`")], ids=["videos", "with-options"])
def test_an_unknown_field_lists_exactly_the_fields_the_endpoint_accepts(tmp_path: Path, options: tuple[str, ...],
                                                                       accepted: str) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    with pytest.raises(InputError) as exc:
        build_request(_wan_i2v_state(tmp_path), {"prompt": "x", "image": _png(), "foo": 1}, folder, options)
    assert (exc.value.field, str(exc.value)) == ("foo", f"`foo` (got 1) is not a field of this endpoint; it takes: "
                                                        f"{accepted}")
    exc = _refusal(_wan_i2v_state(tmp_path), {"prompt": "x", "image": _png(), "sizes": "64x64"}, tmp_path)
    assert (exc.field, str(exc)) == ("sizes", "`sizes` (got '64x64') is not a field of this endpoint; did you mean "
                                              f"`size`?; it takes: {I2V_FIELDS}")


def test_each_accepted_field_is_taken(tmp_path: Path) -> None:
    """The list above is not a guess: a body of every listed field (but `input_reference`, the same frame as
    `image`, and `size`/`seconds`, the same shape as the target fields) builds a request."""
    folder = tmp_path / "job"
    folder.mkdir()
    body = {"prompt": "x", "negative_prompt": "y", "image": _png(), "seed": 1, "target_height": 64,
            "target_width": 64, "target_video_length": 5, "model": _wan_i2v_state(tmp_path).runner.config.model_cls}
    request, _, _ = build_request(_wan_i2v_state(tmp_path), body, folder)
    assert (request.seed, request.target_video_length) == (1, 5)


def test_a_size_out_of_bounds_speaks_of_size(tmp_path: Path) -> None:
    exc = _refusal(_wan_i2v_state(tmp_path), {"prompt": "x", "image": _png(), "size": "0x0"}, tmp_path)
    assert (exc.field, str(exc)) == ("size", "invalid request:\n  `size` '0x0' (height): Input should be greater "
                                             "than 0 (got 0)\n  `size` '0x0' (width): Input should be greater than 0 "
                                             "(got 0)")


def test_a_long_prompt_counts_its_own_characters(tmp_path: Path) -> None:
    exc = _refusal(_wan_i2v_state(tmp_path), {"prompt": "x" * 20001, "image": _png()}, tmp_path)
    assert (exc.field, str(exc)) == ("prompt", "invalid request:\n  prompt: String should have at most 20000 "
                                               f"characters (got '{'x' * 99}... (20001 characters))")


@pytest.mark.parametrize(("sent", "param"), [({"size": "8000x8000"}, "size"),
                                             ({"target_height": 8000, "target_width": 8000}, "target_width"),
                                             ({"target_video_length": 1025}, "target_video_length"),
                                             ({"seconds": "128"}, "seconds"), ({}, None)],
                         ids=["size", "target_fields", "frames", "seconds", "defaults"])
def test_a_shape_that_does_not_fit_names_the_shape_field_sent(tmp_path: Path, sent: dict[str, Any],
                                                              param: str | None) -> None:
    """The memory check refuses the shape as a whole: `param` is the first shape field the client sent, as
    sent (`size`, `seconds`), and null only when the client sent none (the config's default shape)."""
    state = _wan_i2v_state(tmp_path)
    fit_error = "request 8000x8000x81 needs an estimated 912.0 GiB; the device offers 79.1 GiB"

    def refuse(shape: Any, what: str) -> None:
        raise MemoryFitError(fit_error)

    state.runner.memory_checks.check_fit = refuse  # type: ignore[method-assign]
    exc = _refusal(state, {"prompt": "x", "image": _png(), **sent}, tmp_path)
    assert (exc.status, exc.field, str(exc)) == (422, param, fit_error)


@pytest.mark.parametrize("seconds", ["abc", "", "nan", True, None, [4]])
def test_seconds_that_is_not_a_number_says_so(tmp_path: Path, seconds: Any) -> None:
    with pytest.raises(InputError) as exc:
        _frames_of(seconds, _wan_i2v_state(tmp_path), 8)
    assert (exc.value.field, str(exc.value)) == (
        "seconds", f"`seconds` {seconds!r} is not a number: give seconds from {SECONDS_ALLOWED}")


def test_seconds_out_of_range_says_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(InputError) as exc:
        _frames_of("129", _wan_i2v_state(tmp_path), 8)
    assert str(exc.value) == f"`seconds` '129' is out of range: from {SECONDS_ALLOWED}"


@pytest.mark.parametrize("field", ["input_reference", "image"])
def test_an_unreadable_first_frame_is_named_as_sent(tmp_path: Path, field: str) -> None:
    exc = _refusal(_wan_i2v_state(tmp_path), {"prompt": "x", field: b"not an image"}, tmp_path)
    assert (exc.field, str(exc)) == (field, f"`{field}` (uploaded) is not an image Pillow can read (PNG, JPEG, WebP, "
                                            "BMP, ... expected)")


def test_a_last_frame_the_task_does_not_take_names_the_fields_as_sent(tmp_path: Path) -> None:
    """i2v takes a first frame only: a `last_frame` upload is refused naming the body field that i2v takes
    (`image`), not the launch script's `image_path`, and the upload without its server path."""
    exc = _refusal(_wan_i2v_state(tmp_path), {"prompt": "x", "image": _png(), "last_frame": _png()}, tmp_path)
    assert (exc.field, str(exc)) == ("last_frame", "`last_frame` is not used by task 'i2v' (an uploaded image); "
                                                   "image inputs of this task: `image`")
