"""Request admission: the one path every entry point takes before a request may run.

    admit(target, config, requests, *, source, claim=None) -> list[AdmittedRequest]

`source` names the entry point, and `RULES[source]` the rules it applies, in order; each rule runs
once per request and sees every request before the next rule starts (so the first problem reported
is the same whatever the number of requests):

    rule       what it checks                                                      raises (the cause)
    fields     shape factors, image inputs, adapter files, result suffix, and the  ValueError naming the
               family's own rules (`validate_request`; image-conditioned and edit  field
               runners add theirs as overrides)
    outputs    every output path can be created and is written by one request     ConfigError (`claim`)
    writer     the media library for the result file (mp4 / png) is installed     ConfigError
    adapters   the request's LoRA adapters match the loaded transformer's layers  ValueError (LoRAError)
    fit        the shape's estimated peak memory fits the device                  ValueError (MemoryFitError)
               (`runner.memory_checks.check_request`, planning/checks.py)
    split      Ulysses: the transformer's tokens divide by `parallel.ulysses`     NotImplementedError

The launch script (`source="launch"`, a runner class, before anything loads) applies fields, outputs
and writer; its memory fit is planned for every request's shapes at once (`memory_checks.check_requests_fit`) and
its adapters are matched once the transformer is loaded (`check_adapters`). The parallel driver
(`source="parallel"`, after `init_modules`) applies split to the launch's requests. The server
(`source="server"`, a loaded runner, one request per job) applies fields, adapters, fit and split.

An admitted request is an `AdmittedRequest` (a `RequestConfig` with the same fields), which the
runner's `resolve_request` does not check again. Its memory fit, once checked (the server's `fit` rule, the
launch script's `check_requests_fit`), is recorded with the shape it was checked for (`fit_checked`), and the
runner does not check it again before the request's first stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import PrivateAttr

from runnerkit.config import ConfigError, RequestConfig

__all__ = ["RULES", "AdmittedRequest", "Refused", "admit", "admitted", "check_default_shape"]


class AdmittedRequest(RequestConfig):
    """A request that passed `admit` (its fields are those of the `RequestConfig` it was made from): the
    runner's `resolve_request` fills its defaults without running the `fields` rule again, and its memory fit is
    checked again only at a shape other than `fit_checked`."""

    _fit_checked: tuple[int, int, int] | None = PrivateAttr(None)

    @property
    def fit_checked(self) -> tuple[int, int, int] | None:
        """The shape (height, width, frames) whose estimated peak memory was checked against the runner's device
        budget (planning/checks.py `MemoryChecks.check_request`, `check_requests_fit`), which the runner keeps for
        its life; None: not checked with an estimate (the runner checks it before the request's first stage)."""
        return self._fit_checked

    def record_fit_check(self, shape: tuple[int, int, int]) -> None:
        """Record that the fit of `shape` was checked with an estimate (`fit_checked`)."""
        self._fit_checked = tuple(shape)


class Refused(Exception):
    """A rule refused requests. `rule`: its name (`RULES`); `problems`: (request index, the rule's error), in
    request order (the `fields` rule reports every request it refuses, the others the first; the parallel
    `split` rule reports index 0, its message naming the refused request's index and source)."""

    def __init__(self, rule: str, problems: list[tuple[int, Exception]]) -> None:
        super().__init__(str(problems[0][1]))
        self.rule, self.problems = rule, problems

    @property
    def cause(self) -> Exception:
        """The first refused request's error."""
        return self.problems[0][1]


def admitted(request: RequestConfig) -> AdmittedRequest:
    """`request` marked as admitted: the same fields (and fields set), the same `source`."""
    if isinstance(request, AdmittedRequest):
        return request
    marked = AdmittedRequest.model_construct(_fields_set=set(request.model_fields_set),
                                             **{name: getattr(request, name) for name in RequestConfig.model_fields})
    marked._source = request._source
    return marked


# ---- the rules: (target, config, requests, claim) -> problems (index, error) -------------------------------------
Problems = list[tuple[int, Exception]]


def _fields(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    runner_cls = target if isinstance(target, type) else type(target)
    problems: Problems = []
    for index, request in enumerate(requests):  # every bad request is reported at once
        try:
            runner_cls.validate_request(request, config)
        except ValueError as exc:
            problems.append((index, exc))
    return problems


def _outputs(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    from runnerkit.media import sidecar_path

    assert claim is not None, "the outputs rule needs the entry point's `claim`"
    for index, request in enumerate(requests):
        owner = f"the request on {request.source}"
        try:
            if request.save_tensor_path:
                claim(request.save_tensor_path, "save_tensor_path", owner)
            if request.save_result_path:
                claim(request.save_result_path, "save_result_path", owner)
                claim(str(sidecar_path(request.save_result_path)), "sidecar .json of save_result_path", owner)
        except ConfigError as exc:
            return [(index, exc)]
    return []


def _writer(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    from runnerkit.media import MEDIA_EXTRA, missing_media_module

    for index, request in enumerate(requests):  # before loading: without it a run would fail only at its save
        missing = missing_media_module(request.save_result_path) if request.save_result_path else None
        if missing:
            return [(index, ConfigError(f"`save_result_path` {request.save_result_path!r} (request on "
                                        f"{request.source}) needs {MEDIA_EXTRA}; missing: {missing}"))]
    return []


def _adapters(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    for index, request in enumerate(requests):
        if request.lora:  # matched to the loaded transformer's layers: a bad adapter is the request's error
            try:
                target.check_adapters([request])
            except ValueError as exc:
                return [(index, exc)]
    return []


def _fit(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    for index, request in enumerate(requests):
        try:
            target.memory_checks.check_request(request, target.request_shape(request), "request")
        except ValueError as exc:
            return [(index, exc)]
    return []


def _split(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    """The server's rule, request by request: the message of `check_sequence_split`."""
    check = getattr(target, "check_sequence_split", None)
    for index, request in enumerate(requests):
        try:
            if check is not None:
                check(target.resolve_request(request))
        except NotImplementedError as exc:
            return [(index, exc)]
    return []


def _split_launch(target: Any, config: Any, requests: Sequence[RequestConfig], claim: Any) -> Problems:
    """The parallel launch's rule, after `init_modules`: `check_requests_split`, whose message names the first
    refused request's index and source."""
    try:
        target.check_requests_split(requests)
    except (ValueError, NotImplementedError) as exc:
        return [(0, exc)]
    return []


Rule = Callable[[Any, Any, Sequence[RequestConfig], Any], Problems]
#: The rules each entry point applies, in order: (name, rule).
RULES: dict[str, tuple[tuple[str, Rule], ...]] = {
    "launch": (("fields", _fields), ("outputs", _outputs), ("writer", _writer)),
    "parallel": (("split", _split_launch),),
    "server": (("fields", _fields), ("adapters", _adapters), ("fit", _fit), ("split", _split)),
}


def admit(target: Any, config: Any, requests: Sequence[RequestConfig], *, source: str,
          claim: Callable[[str, str, str], None] | None = None) -> list[AdmittedRequest]:
    """Apply the rules of entry point `source` (`RULES`) to `requests`, each rule to every request in turn.

    Args:
        target: the runner class (`launch`: nothing is built yet) or the runner (`server`, `parallel`).
        config: the runner config the requests are checked against (`launch`: as the user gave it).
        requests: the requests, in order (the server: one).
        source: `launch`, `parallel` or `server`.
        claim: `outputs` rule only: `claim(path, field, owner)` raises ConfigError for a path that cannot be
            written or is written twice (the launch script's, which also knows its own output flags).

    Returns:
        The requests as `AdmittedRequest`s, in order (`parallel`: the launch's, already admitted, as given).

    Raises:
        Refused: naming the rule, and each refused request's index with its error.
        ValueError: an unknown `source` (naming the known ones).
    """
    if source not in RULES:
        raise ValueError(f"`source` {source!r} is not an entry point; one of {sorted(RULES)}")
    # marked first, so that a later rule's `resolve_request` checks nothing twice; `parallel` gets the requests the
    # launch admitted before loading, and returns them as they are
    marked = list(requests) if source == "parallel" else [admitted(request) for request in requests]
    for rule, check in RULES[source]:
        problems = check(target, config, marked, claim)
        if problems:
            raise Refused(rule, problems)
    return marked


def check_default_shape(runner_cls: type, config: Any, source: str) -> None:
    """The config's own default shape (the shape of every request that gives none) must be one the runner takes.

    Raises:
        ConfigError: naming `source` (`cli_common.config_source`) and the bad field; a problem there is the
            config's, not a request's (the server would otherwise start and fail every job that omits the field).
    """
    try:
        resolved = runner_cls.resolve_config(config)
    except ValueError as exc:  # a combination the family's defaults make
        raise ConfigError(f"{source}: {exc}") from None
    try:
        runner_cls.validate_shape(resolved.target_height, resolved.target_width, resolved.target_video_length)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc} (the default shape of every request)") from None
